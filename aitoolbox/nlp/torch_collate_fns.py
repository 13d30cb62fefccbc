"""Collate functions for NLP batches of variable-length token sequences."""
from typing import Any, Sequence, Tuple

import torch


def _pad_with_lengths(sequences: Sequence[Any]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Right-pad 1-D index sequences with 0 to the batch's longest; return ``(padded, lengths)``, both int64."""
    tensors = [torch.as_tensor(seq, dtype=torch.long) for seq in sequences]
    for position, tensor in enumerate(tensors):
        if tensor.dim() != 1:
            raise ValueError(f"sequence {position} of the batch has shape {tuple(tensor.shape)}; each sequence "
                             "must be a 1-D sequence of token indices")
    lengths = torch.tensor([len(tensor) for tensor in tensors], dtype=torch.long)
    return torch.nn.utils.rnn.pad_sequence(tensors, batch_first=True, padding_value=0), lengths


def qa_concat_ctx_span_collate_fn(data: Sequence[Tuple[Any, Any, Any]]) -> Tuple[torch.Tensor, ...]:
    """Collate ``(paragraph, question, answer span)`` samples into padded batch tensors (dynamic padding).

    Paragraphs and questions are right-padded with 0 (the vocabulary's ``PAD_token``) to the longest one in
    the batch, so batches are no wider than they need to be.

    Args:
        data: the samples, each ``(paragraph indices, question indices, (span start, span end))``; the
            sequences are 1-D tensors or lists of token indices.

    Returns:
        ``(paragraphs, paragraph_lengths, questions, question_lengths, spans)``: the padded paragraphs
        ``(batch, longest paragraph)``, their true lengths ``(batch,)``, the same for the questions, and the
        spans ``(batch, 2)``; all int64.

    Raises:
        ValueError: the batch is empty or a sequence is not 1-D.
    """
    if len(data) == 0:
        raise ValueError("qa_concat_ctx_span_collate_fn got an empty batch")
    paragraphs, questions, spans = zip(*data)
    paragraph_pad, paragraph_lengths = _pad_with_lengths(paragraphs)
    question_pad, question_lengths = _pad_with_lengths(questions)
    span_tensor = torch.stack([torch.as_tensor(span, dtype=torch.long).reshape(-1) for span in spans])
    return paragraph_pad, paragraph_lengths, question_pad, question_lengths, span_tensor
