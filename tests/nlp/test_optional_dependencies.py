"""aitoolbox.nlp imports without its optional libraries, and a metric that needs one says what to install.

Run in fresh interpreters: one where rouge-score, sacrebleu, nltk and matplotlib cannot be imported (an import
hook refuses them, as if they were not installed), and one that checks importing loads none of them.
"""
import subprocess
import sys
import textwrap

MODULES = ["aitoolbox.nlp", "aitoolbox.nlp.core.core", "aitoolbox.nlp.core.vocabulary",
           "aitoolbox.nlp.torch_collate_fns", "aitoolbox.nlp.experiment_evaluation.NLP_metrics",
           "aitoolbox.nlp.experiment_evaluation.NLP_result_package",
           "aitoolbox.nlp.experiment_evaluation.attention_heatmap"]
OPTIONAL = ["rouge_score", "sacrebleu", "nltk", "matplotlib"]


def run_python(code: str, cwd) -> str:
    completed = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                               timeout=120, cwd=cwd)
    assert completed.returncode == 0, completed.stderr
    return completed.stdout


def test_importing_loads_no_optional_library(tmp_path):
    output = run_python(f"""
        import importlib, sys
        for module in {MODULES!r}:
            importlib.import_module(module)
        print(sorted({{name.split('.')[0] for name in sys.modules}} & set({OPTIONAL!r})))
    """, tmp_path)
    assert output.strip() == "[]"


def test_without_the_libraries_metrics_name_the_extra_and_the_rest_works(tmp_path):
    output = run_python(f"""
        import importlib.abc, sys

        class Refuse(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split('.')[0] in {OPTIONAL!r}:
                    raise ImportError(f"No module named {{name!r}}")

        sys.meta_path.insert(0, Refuse())
        from aitoolbox.nlp.core.vocabulary import Vocabulary
        from aitoolbox.nlp.experiment_evaluation.NLP_metrics import *
        from aitoolbox.nlp.experiment_evaluation.attention_heatmap import AttentionHeatMap

        # Metrics without optional libraries work.
        print(ExactMatchTextMetric([['a']], [['a']]).get_metric(),
              round(F1TextMetric([['x', 'y']], [['x']]).get_metric(), 6))
        print(round(PerplexityMetric([0.0]).get_metric(), 6), GLUEMetric([1, 0], [1, 1], 'rte').get_metric())
        vocab = Vocabulary('v'); vocab.add_sentence(['x'])
        print(vocab.convert_sent2idx_sent(['x']))

        attempts = [
            ('rouge-score', lambda: ROUGEMetric([['a']], [['a']])),
            ('rouge-score', lambda: ROUGEPerlMetric([['a']], [['a']], 'unused_dir')),
            ('nltk', lambda: BLEUSentenceScoreMetric([['a']], [['a']])),
            ('nltk', lambda: BLEUCorpusScoreMetric([['a']], [['a']])),
            ('sacrebleu', lambda: BLEUScoreStrTorchNLPMetric([['a']], [['a']])),
            ('matplotlib', lambda: AttentionHeatMap([[[1.0]]], [['a']], [['b']], 'unused_plots')),
        ]
        for package, attempt in attempts:
            try:
                attempt()
            except ImportError as error:
                message = str(error)
                print(package in message and 'pip install aitoolbox[nlp]' in message)
            else:
                print('no ImportError')
    """, tmp_path)
    lines = output.strip().splitlines()
    assert lines[:3] == ["100.0 66.666667", "1.0 {'acc': 0.5}", "[2, 4, 3]"]
    assert lines[3:] == ["True"] * 6
    assert list(tmp_path.iterdir()) == []  # a missing library is found before any file is written
