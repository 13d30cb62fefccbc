"""NLP metrics (:mod:`.NLP_metrics`), attention heat maps (:mod:`.attention_heatmap`) and the NLP result
packages (:mod:`.NLP_result_package`)."""
