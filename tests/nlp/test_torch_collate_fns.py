"""aitoolbox.nlp.torch_collate_fns.qa_concat_ctx_span_collate_fn in a real DataLoader."""
import pytest
import torch
from torch.utils.data import DataLoader

from aitoolbox.nlp.torch_collate_fns import qa_concat_ctx_span_collate_fn

SAMPLES = [
    (torch.tensor([5, 6, 7]), torch.tensor([8, 9]), (0, 1)),
    (torch.tensor([4, 5, 6, 7, 8]), torch.tensor([9]), (2, 4)),
    ([10, 11], [12, 13, 14], torch.tensor([1, 1])),
]


def test_pads_paragraphs_and_questions_to_the_longest_in_the_batch():
    paragraphs, paragraph_lengths, questions, question_lengths, spans = qa_concat_ctx_span_collate_fn(SAMPLES)
    assert torch.equal(paragraphs, torch.tensor([[5, 6, 7, 0, 0], [4, 5, 6, 7, 8], [10, 11, 0, 0, 0]]))
    assert torch.equal(paragraph_lengths, torch.tensor([3, 5, 2]))
    assert torch.equal(questions, torch.tensor([[8, 9, 0], [9, 0, 0], [12, 13, 14]]))
    assert torch.equal(question_lengths, torch.tensor([2, 1, 3]))
    assert torch.equal(spans, torch.tensor([[0, 1], [2, 4], [1, 1]]))
    for tensor in (paragraphs, paragraph_lengths, questions, question_lengths, spans):
        assert tensor.dtype == torch.long


def test_in_a_data_loader_each_batch_is_padded_on_its_own():
    loader = DataLoader(SAMPLES, batch_size=2, collate_fn=qa_concat_ctx_span_collate_fn)
    first, second = list(loader)
    assert first[0].shape == (2, 5) and first[2].shape == (2, 2)
    assert second[0].shape == (1, 2) and second[2].shape == (1, 3)


def test_rejects_empty_batches_and_non_1d_sequences():
    with pytest.raises(ValueError, match="empty batch"):
        qa_concat_ctx_span_collate_fn([])
    with pytest.raises(ValueError, match="must be a 1-D sequence"):
        qa_concat_ctx_span_collate_fn([(torch.zeros(2, 2, dtype=torch.long), [1], (0, 0))])
