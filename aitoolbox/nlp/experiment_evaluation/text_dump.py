"""Writing predicted and reference texts to files, one file per example, so they can be read next to the scores.

The files do not affect any metric. Writing again into the same folder first removes the files of the earlier
dump (those named as these helpers name them), so a smaller evaluation leaves no stale examples behind; other
files in the folder are left alone (aitoolbox 1.x deleted the whole folder). Under distributed training every
process computes the metrics but only the main process (global rank 0) touches the files, so the processes do
not delete and write the same files at once.
"""
import glob
import os
import shutil
from typing import Any, Iterable, Sequence

import torch.distributed as dist

ANSWER_FILE_PATTERN = "answer_pred_true_{}.txt"
TRANSLATION_FILE_PATTERN = "transl_{}.txt"


def is_main_process() -> bool:
    """True outside distributed training and in the process of global rank 0."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def prepare_dump_folder(output_dir: str, file_pattern: str) -> str:
    """Create ``output_dir`` where missing and remove the files an earlier dump named with ``file_pattern``.

    Args:
        output_dir: the folder.
        file_pattern: the file name pattern with ``{}`` for the example's position.

    Returns:
        The folder's path (``~`` expanded).
    """
    output_dir = os.path.expanduser(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    for stale in glob.glob(os.path.join(glob.escape(output_dir), file_pattern.format("*"))):
        os.remove(stale)
    return output_dir


def reset_subfolder(output_dir: str, subfolder: str) -> str:
    """Empty (or create) ``output_dir/subfolder``, a folder that holds only files these helpers write."""
    path = os.path.join(os.path.expanduser(output_dir), subfolder)
    if not is_main_process():
        return path
    if os.path.isdir(path):
        shutil.rmtree(path)
    os.makedirs(path)
    return path


def as_text(tokens_or_text: Any) -> str:
    """A string as it is; a sequence of tokens joined with single spaces."""
    if isinstance(tokens_or_text, str):
        return tokens_or_text
    return " ".join(str(token) for token in tokens_or_text)


def write_answer_texts(true_texts: Sequence[str], pred_texts: Sequence[str], output_dir: str) -> str:
    """Write ``answer_pred_true_<i>.txt`` per question: its predicted and true answer.

    Returns:
        The folder's path.
    """
    if not is_main_process():
        return os.path.expanduser(output_dir)
    output_dir = prepare_dump_folder(output_dir, ANSWER_FILE_PATTERN)
    for position, (pred_text, true_text) in enumerate(zip(pred_texts, true_texts)):
        path = os.path.join(output_dir, ANSWER_FILE_PATTERN.format(position))
        with open(path, "w", encoding="utf-8") as file:
            file.write(f"Answer to question {position}:\nPredicted:\t{pred_text}\nTrue:\t{true_text}\n")
    return output_dir


def write_translation_texts(source_sents: Sequence[Any], pred_translations: Sequence[str],
                            true_translations: Sequence[str], scores: Iterable[Any], output_dir: str) -> str:
    """Write ``transl_<i>.txt`` per sentence: its source, predicted and true translation and its BLEU score.

    Returns:
        The folder's path.
    """
    if not is_main_process():
        return os.path.expanduser(output_dir)
    output_dir = prepare_dump_folder(output_dir, TRANSLATION_FILE_PATTERN)
    rows = zip(source_sents, pred_translations, true_translations, scores)
    for position, (source, pred_text, true_text, score) in enumerate(rows):
        path = os.path.join(output_dir, TRANSLATION_FILE_PATTERN.format(position))
        with open(path, "w", encoding="utf-8") as file:
            file.write(f"Source:\t{as_text(source)}\nPredicted:\t{pred_text}\nTrue:\t{true_text}\nBLEU: {score}\n")
    return output_dir
