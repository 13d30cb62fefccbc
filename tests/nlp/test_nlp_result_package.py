"""The NLP result packages: on their own, and end to end through TrainLoop's prediction path (the evaluation
callback, the EndSave preset and PyTorchModelPredictor), checked against metrics computed independently."""
import json
import math
import os
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from aitoolbox.nlp.core.vocabulary import Vocabulary
from aitoolbox.nlp.experiment_evaluation.NLP_result_package import (
    GLUEResultPackage,
    MachineTranslationResultPackage,
    QuestionAnswerResultPackage,
    QuestionAnswerSpanClassificationResultPackage,
    TextSummarizationResultPackage,
    XNLIResultPackage,
)
from aitoolbox.torchtrain.callbacks.abstract import AbstractCallback
from aitoolbox.torchtrain.callbacks.performance_eval import ModelPerformanceEvaluation
from aitoolbox.torchtrain.model import TTModel
from aitoolbox.torchtrain.model_predict import PyTorchModelPredictor
from aitoolbox.torchtrain.train_loop import TrainLoop, TrainLoopCheckpoint, TrainLoopEndSave

sacrebleu = pytest.importorskip("sacrebleu")
rouge_scorer = pytest.importorskip("rouge_score.rouge_scorer")
pytest.importorskip("nltk")

NUM_WORDS = 10  # words 'w0'..'w9' get indices 4..13 after the 4 reserved tokens
VOCAB_SIZE = 4 + NUM_WORDS


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def word_vocabulary() -> Vocabulary:
    vocabulary = Vocabulary("words")
    vocabulary.add_sentence([f"w{i}" for i in range(NUM_WORDS)])
    return vocabulary


def squad_f1(gold, pred):
    """SQuAD's token F1 written out for these lowercase one-word tokens (no normalisation needed)."""
    if not gold or not pred:
        return float(gold == pred)
    shared = sum((Counter(gold) & Counter(pred)).values())
    return 0. if shared == 0 else 2 * shared / (len(gold) + len(pred))


# --- question answering ---------------------------------------------------------------------------------------
PARAGRAPHS = [["the", "tower", "was", "built", "in", "1889"], ["paris", "is", "the", "capital", "of", "france"]]


def test_question_answer_package_from_spans():
    package = QuestionAnswerResultPackage(PARAGRAPHS)
    # question 1: true 'built in 1889', predicted 'in 1889'; question 2: true 'paris', predicted 'paris'
    package.prepare_result_package(np.array([[3, 5], [0, 0]]), np.array([[4, 5], [0, 0]]))
    results = package.get_results()
    assert list(results) == ["ROGUE", "EM", "F1"]
    assert results["EM"] == 50.
    assert results["F1"] == pytest.approx(100 * (2 * 2 / (3 + 2) + 1) / 2)  # P 1, R 2/3 -> 0.8
    assert results["ROGUE"]["rouge-1"]["r"] == pytest.approx((2 / 3 + 1) / 2)


def test_question_answer_package_with_answer_texts_and_flat_results(tmp_path):
    package = QuestionAnswerResultPackage(PARAGRAPHS, target_actual_text=["built in 1889", ["Paris", "Paris, France"]],
                                          flatten_result_dict=True, output_text_dir=str(tmp_path / "answers"))
    package.prepare_result_package([None, None], np.array([[3, 5], [0, 0]]))  # y_true is not read
    results = package.get_results()
    assert results["EM"] == 100. and results["F1"] == 100.
    assert results["ROGUE_rouge-1_f"] == 1. and "ROGUE_rouge-l_p" in results
    assert sorted(os.listdir(tmp_path / "answers")) == ["answer_pred_true_0.txt", "answer_pred_true_1.txt"]
    assert package.get_additional_results_dump_paths() == [["answers.zip", str(tmp_path / "answers.zip")]]


def test_question_answer_package_with_perl_style_rouge(tmp_path):
    package = QuestionAnswerResultPackage(PARAGRAPHS, output_text_dir=str(tmp_path / "perl"), use_perl_rouge=True)
    package.prepare_result_package(np.array([[3, 5], [0, 0]]), np.array([[3, 5], [0, 0]]))
    assert package.get_results()["ROGUE_Perl"]["rouge_1_f_score"] == 1.
    assert os.path.isdir(tmp_path / "perl" / "true_answer")


def test_question_answer_package_rejects_bad_input():
    with pytest.raises(ValueError, match="use_perl_rouge=True needs output_text_dir"):
        QuestionAnswerResultPackage(PARAGRAPHS, use_perl_rouge=True)
    with pytest.raises(ValueError, match="target_actual_text has 1 answers but paragraph_text_tokens has 2"):
        QuestionAnswerResultPackage(PARAGRAPHS, target_actual_text=["x"])
    package = QuestionAnswerResultPackage(PARAGRAPHS)
    with pytest.raises(ValueError, match=r"shape \(N, 2\); got shape \(2,\)"):
        package.prepare_result_package(np.array([1, 2]), np.array([1, 2]))
    with pytest.raises(ValueError, match="has 3 spans but the package was given 2 paragraphs"):
        package.prepare_result_package(np.zeros((3, 2), dtype=int), np.zeros((3, 2), dtype=int))


def test_span_classification_package():
    package = QuestionAnswerSpanClassificationResultPackage()
    package.prepare_result_package(torch.tensor([[1, 2], [0, 3], [4, 4]]), torch.tensor([[1, 2], [0, 2], [3, 4]]))
    assert package.get_results() == {"Accuracy_span_start": pytest.approx(2 / 3),
                                     "Accuracy_span_end": pytest.approx(2 / 3)}
    with pytest.raises(ValueError, match="y_true has 3 samples but y_predicted has 2"):
        package.prepare_result_package(np.zeros((3, 2)), np.zeros((2, 2)))


class SpanModel(TTModel):
    """Start and end logits over the paragraph's positions from per-token embeddings."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB_SIZE, 8)
        self.position = nn.Parameter(torch.zeros(6, 8))
        self.out = nn.Linear(8, 2)

    def forward(self, paragraphs):
        logits = self.out(torch.tanh(self.embedding(paragraphs) + self.position))
        return logits[..., 0], logits[..., 1]

    def get_loss(self, batch_data, criterion, device):
        paragraphs, spans = (tensor.to(device) for tensor in batch_data)
        start, end = self(paragraphs)
        return criterion(start, spans[:, 0]) + criterion(end, spans[:, 1])

    def get_predictions(self, batch_data, device):
        paragraphs, spans = batch_data
        start, end = self(paragraphs.to(device))
        return torch.stack([start.argmax(dim=1), end.argmax(dim=1)], dim=1).cpu(), spans, None


def span_data(num_samples, seed):
    generator = torch.Generator().manual_seed(seed)
    paragraphs = torch.randint(4, VOCAB_SIZE, (num_samples, 6), generator=generator)
    starts = torch.randint(0, 4, (num_samples,), generator=generator)
    spans = torch.stack([starts, starts + torch.randint(0, 2, (num_samples,), generator=generator)], dim=1)
    return paragraphs, spans


class PredictionProbe(AbstractCallback):
    """After the evaluation callback (execution order 1): keeps the validation predictions it was given."""

    def __init__(self):
        super().__init__("prediction probe", execution_order=1)
        self.predictions = []

    def on_epoch_end(self):
        y_pred, y_true, metadata = self.train_loop_obj.predict_on_validation_set()
        self.predictions.append((y_pred.clone(), y_true.clone()))


def test_question_answering_end_to_end_in_the_run_folder(tmp_path):
    vocabulary = word_vocabulary()
    train, val = span_data(32, seed=1), span_data(12, seed=2)
    val_paragraph_words = [vocabulary.convert_idx_sent2sent(p) for p in val[0]]
    torch.manual_seed(0)
    model = SpanModel()
    tl = TrainLoopCheckpoint(model, DataLoader(TensorDataset(*train), batch_size=8),
                             DataLoader(TensorDataset(*val), batch_size=8), None,
                             torch.optim.Adam(model.parameters(), lr=0.05), nn.CrossEntropyLoss(),
                             "nlp", "qa", str(tmp_path), {}, show_progress=False)
    package = QuestionAnswerResultPackage(val_paragraph_words, output_text_dir="qa_answers")
    probe = PredictionProbe()
    tl.fit(num_epochs=3, callbacks=[ModelPerformanceEvaluation(package), probe])

    scorer = rouge_scorer.RougeScorer(["rouge1"])
    for epoch, (y_pred, y_true) in enumerate(probe.predictions):
        pred = [words[s:e + 1] for (s, e), words in zip(y_pred.tolist(), val_paragraph_words)]
        true = [words[s:e + 1] for (s, e), words in zip(y_true.tolist(), val_paragraph_words)]
        assert tl.train_history["val_EM"][epoch] == pytest.approx(100 * np.mean([p == t for p, t in zip(pred, true)]))
        assert tl.train_history["val_F1"][epoch] == pytest.approx(
            100 * np.mean([squad_f1(t, p) for p, t in zip(pred, true)]))
        rouge_1 = np.mean([scorer.score(" ".join(t), " ".join(p))["rouge1"].fmeasure for p, t in zip(pred, true)])
        assert tl.train_history["val_ROGUE"][epoch]["rouge-1"]["f"] == pytest.approx(rouge_1)
    assert len(set(tl.train_history["val_F1"])) > 1  # the model learns: the comparison is not vacuous

    # The answers went into the run folder (the package was told where it is when registered).
    answers_dir = os.path.join(tl.experiment_folder.path, "qa_answers")
    assert package.output_text_dir == answers_dir
    assert len([name for name in os.listdir(answers_dir) if name.startswith("answer_pred_true_")]) == 12
    zip_name, zip_path = package.get_additional_results_dump_paths()[0]
    assert zip_name == "qa_answers.zip" and os.path.isfile(zip_path)


# --- machine translation --------------------------------------------------------------------------------------
class WordTranslator(TTModel):
    """Translates token by token; its attention is the softmax of the embeddings' similarities."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB_SIZE, 16)
        self.out = nn.Linear(16, VOCAB_SIZE)

    def forward(self, source):
        embedded = self.embedding(source)
        return self.out(embedded), torch.softmax(embedded @ embedded.transpose(1, 2) / 4, dim=-1)

    def get_loss(self, batch_data, criterion, device):
        source, target = (tensor.to(device) for tensor in batch_data)
        logits, _ = self(source)
        return criterion(logits.reshape(-1, VOCAB_SIZE), target.reshape(-1))

    def get_predictions(self, batch_data, device):
        source, target = batch_data
        logits, attention = self(source.to(device))
        return logits.argmax(dim=-1).cpu(), target, {"attention_matrices": attention.cpu(), "source_sent_text": source}


def translation_data(num_samples, seed):
    """Sentences of 4 words and EOS; the 'translation' of word i is word (i + 3) mod 10."""
    generator = torch.Generator().manual_seed(seed)
    words = torch.randint(0, NUM_WORDS, (num_samples, 4), generator=generator)
    eos = torch.full((num_samples, 1), 3)
    return torch.cat([words + 4, eos], dim=1), torch.cat([(words + 3) % NUM_WORDS + 4, eos], dim=1)


def translator_loop(**loop_kwargs):
    torch.manual_seed(0)
    model = WordTranslator()
    train, val = translation_data(40, seed=1), translation_data(8, seed=2)
    arguments = (model, DataLoader(TensorDataset(*train), batch_size=8), DataLoader(TensorDataset(*val), batch_size=4),
                 None, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    return arguments, val


class HandWrittenTranslationMetrics(AbstractCallback):
    """Validation perplexity and corpus BLEU at each epoch end, from plain torch and sacrebleu."""

    def __init__(self, val, vocabulary):
        super().__init__("hand-written translation metrics", execution_order=1)
        self.val, self.vocabulary = val, vocabulary
        self.perplexities, self.bleus = [], []

    def on_epoch_end(self):
        model = self.train_loop_obj.model
        source, target = self.val
        model.eval()
        with torch.no_grad():
            logits, _ = model(source)
        model.train()
        nll = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE).double(), target.reshape(-1))
        self.perplexities.append(math.exp(float(nll)))
        hyps = [" ".join(self.vocabulary.convert_idx_sent2sent(s, rm_default_tokens=True)) for s in logits.argmax(-1)]
        refs = [" ".join(self.vocabulary.convert_idx_sent2sent(s, rm_default_tokens=True)) for s in target]
        self.bleus.append(sacrebleu.corpus_bleu(hyps, [refs], tokenize="none", smooth_method="none").score / 100)


def test_machine_translation_end_to_end_with_heat_maps(tmp_path):
    vocabulary = word_vocabulary()
    arguments, val = translator_loop()
    tl = TrainLoop(*arguments, show_progress=False)
    source_texts = [" ".join(vocabulary.convert_idx_sent2sent(s, rm_default_tokens=True)) for s in val[0]]
    package = MachineTranslationResultPackage(vocabulary, source_vocab=vocabulary, source_sents=source_texts,
                                              output_text_dir=str(tmp_path / "translations"),
                                              output_attn_heatmap_dir=str(tmp_path / "attention"))
    assert package.requires_loss
    by_hand = HandWrittenTranslationMetrics(val, vocabulary)
    tl.fit(num_epochs=3, callbacks=[ModelPerformanceEvaluation(package), by_hand])

    history = tl.train_history
    assert history["val_Perplexity"] == pytest.approx(by_hand.perplexities, rel=1e-5)
    assert history["val_Perplexity"] == pytest.approx([math.exp(loss) for loss in history["val_loss"]], rel=1e-9)
    assert history["val_BLEU_corpus_score"] == pytest.approx(by_hand.bleus, abs=1e-9)
    assert by_hand.perplexities[-1] < by_hand.perplexities[0] and by_hand.bleus[-1] > by_hand.bleus[0]  # learns
    assert all(0 <= value <= 1 for value in history["val_BLEU_sentence_score"])

    plots = history["val_Attention_HeatMap"][-1]
    assert len(plots) == 8 and all(os.path.isfile(path) for path in plots)
    assert len(os.listdir(tmp_path / "translations")) == 8
    assert (tmp_path / "translations" / "transl_0.txt").read_text(encoding="utf-8").startswith(
        f"Source:\t{source_texts[0]}\n")
    names = sorted(name for name, _ in package.get_additional_results_dump_paths())
    assert names == ["attention.zip", "translations.zip"]


def test_machine_translation_in_the_end_save_preset(tmp_path):
    vocabulary = word_vocabulary()
    arguments, val = translator_loop()
    by_hand = HandWrittenTranslationMetrics(val, vocabulary)
    tl = TrainLoopEndSave(*arguments, "nlp", "mt", str(tmp_path), {},
                          val_result_package=MachineTranslationResultPackage(vocabulary), show_progress=False)
    tl.fit(num_epochs=2, callbacks=[by_hand])
    with open(os.path.join(tl.experiment_folder.results_dir, "results.json")) as handle:
        results = json.load(handle)["results"]["validation"]
    assert results["Perplexity"] == pytest.approx(by_hand.perplexities[-1], rel=1e-5)
    assert results["BLEU_corpus_score"] == pytest.approx(by_hand.bleus[-1], abs=1e-9)


def test_machine_translation_through_the_predictor_needs_the_loss_in_the_metadata():
    vocabulary = word_vocabulary()
    arguments, val = translator_loop()
    predictor = PyTorchModelPredictor(arguments[0], DataLoader(TensorDataset(*val), batch_size=4))
    with pytest.raises(ValueError, match="perplexity needs 'loss' in the prediction metadata"):
        predictor.evaluate_result_package(MachineTranslationResultPackage(vocabulary))


def test_machine_translation_package_checks_its_arguments():
    vocabulary = word_vocabulary()
    with pytest.raises(ValueError, match="pass the source sentences"):
        MachineTranslationResultPackage(vocabulary, output_text_dir="out")
    with pytest.raises(ValueError, match="pass the source language's Vocabulary"):
        MachineTranslationResultPackage(vocabulary, output_attn_heatmap_dir="out")


def test_machine_translation_package_on_index_lists():
    vocabulary = word_vocabulary()
    package = MachineTranslationResultPackage(vocabulary)
    # 'w0 w1 w2 w3 w4 w5' vs 'w0 w1 w2 w3 w4 w9' after dropping SOS / EOS / PAD: p1 5/6 ... p4 2/3, no brevity
    package.prepare_result_package([[2, 4, 5, 6, 7, 8, 9, 3]], [[2, 4, 5, 6, 7, 8, 13, 3, 0]],
                                   additional_results={"loss": [0.5, 1.5]})
    expected_bleu = (5 / 6 * 4 / 5 * 3 / 4 * 2 / 3) ** 0.25
    assert package.get_results() == pytest.approx({"BLEU_corpus_score": expected_bleu,
                                                   "BLEU_sentence_score": expected_bleu, "Perplexity": math.e})
    assert package.y_predicted_text == [["w0", "w1", "w2", "w3", "w4", "w9"]]


def test_machine_translation_package_on_variable_length_tensors(tmp_path):
    # aitoolbox 1.x's translation example: get_predictions returns lists of 1-D tensors of different lengths
    # (collected with append_concat_predictions and keep_list_transf) and one attention matrix per sentence.
    vocabulary = word_vocabulary()
    package = MachineTranslationResultPackage(vocabulary, source_vocab=vocabulary,
                                              output_attn_heatmap_dir=str(tmp_path))
    y_true = [torch.tensor([4, 5, 6, 3]), torch.tensor([7, 3])]
    y_pred = [torch.tensor([4, 5, 6, 3]), torch.tensor([7, 8, 9, 3])]
    metadata = {"loss": 0., "source_sent_text": [torch.tensor([10, 11, 12]), torch.tensor([13])],
                "attention_matrices": [torch.rand(4, 3), torch.rand(4, 1)]}
    results = package.prepare_result_package(y_true, y_pred, additional_results=metadata).get_results()
    assert package.y_predicted_text == [["w0", "w1", "w2"], ["w3", "w4", "w5"]]
    assert results["Perplexity"] == 1.
    assert len(results["Attention_HeatMap"]) == 2 and all(os.path.isfile(path) for path in results["Attention_HeatMap"])


# --- summarisation, GLUE, XNLI ---------------------------------------------------------------------------------
def test_text_summarization_package():
    package = TextSummarizationResultPackage()
    package.prepare_result_package(["the cat sat on the mat", "a b"], [["the", "cat", "on", "the", "mat"], "c d"])
    results = package.get_results()
    assert results["ROGUE_rouge-1_f"] == pytest.approx(10 / 11 / 2)  # 10/11 and 0, averaged
    assert results["ROGUE_rouge-2_p"] == pytest.approx(3 / 4 / 2)
    assert len(results) == 9


def test_glue_and_xnli_packages():
    glue = GLUEResultPackage("mrpc").prepare_result_package(torch.tensor([1, 0, 1, 1]), torch.tensor([1, 0, 0, 1]))
    assert glue.pkg_name == "GLUE benchmark"
    assert glue.get_results() == pytest.approx({"GLUE_mrpc_acc": 0.75, "GLUE_mrpc_f1": 0.8,
                                                "GLUE_mrpc_acc_and_f1": 0.775})
    class_scores = np.array([[5., 0, 0], [0, 5., 0], [5., 0, 0]])
    xnli = XNLIResultPackage().prepare_result_package(np.array([0, 1, 2]), class_scores)
    assert xnli.get_results() == pytest.approx({"xnli_accuracy_acc": 2 / 3})
    with pytest.raises(ValueError, match="unknown GLUE task_name 'mrcp'"):
        GLUEResultPackage("mrcp")
