"""The model and data shared by the two AMP examples: a small CNN on scikit-learn's bundled digits.

The 1,797 8x8 grey-scale digits ship with scikit-learn, so the examples run anywhere without a download.
The model is a :class:`~aitoolbox.torchtrain.model.TTModel` ending in ``log_softmax``, trained with
``nn.NLLLoss`` as in the apex AMP examples.
"""
from typing import Tuple

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from aitoolbox.torchtrain.model import TTModel


class CNNModel(TTModel):
    """Two convolutions (with BatchNorm) and a classifier head; returns log-probabilities."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, kernel_size=3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 64, kernel_size=3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Dropout(0.25), nn.Linear(128, num_classes),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.classifier(self.features(images)), dim=1)

    def get_loss(self, batch_data, criterion, device):
        images, labels = batch_data
        return criterion(self(images.to(device)), labels.to(device))

    def get_predictions(self, batch_data, device):
        images, labels = batch_data
        return self(images.to(device)).argmax(dim=1).cpu(), labels, None


def digits_loaders(batch_size: int, seed: int = 0) -> Tuple[DataLoader, DataLoader, DataLoader]:
    """Train / validation / test loaders over the digits (70 / 15 / 15 %, stratified, fixed by ``seed``)."""
    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    labels = torch.tensor(digits.target, dtype=torch.long)
    idx_train, idx_rest = train_test_split(range(len(labels)), test_size=0.3, stratify=labels, random_state=seed)
    idx_val, idx_test = train_test_split(idx_rest, test_size=0.5, stratify=labels[idx_rest], random_state=seed)

    def loader(indices, shuffle: bool) -> DataLoader:
        dataset = TensorDataset(images[indices], labels[indices])
        return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle,
                          generator=torch.Generator().manual_seed(seed) if shuffle else None)

    return loader(idx_train, True), loader(idx_val, False), loader(idx_test, False)


def accuracy(y_pred: torch.Tensor, y_true: torch.Tensor) -> float:
    """Fraction of correct predictions."""
    return (y_pred == y_true).float().mean().item()
