"""A compact Vision Transformer (Dosovitskiy et al., 2021) as a TTModel, and the example's synthetic images.

The data are generated, not downloaded: every class has a fixed random smooth "prototype" image, and each
sample is its class's prototype plus Gaussian noise. A model has something real to learn, and the data are
the same on every machine and in every process for the same seed.
"""
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from aitoolbox.torchtrain.model import TTModel


class Attention(nn.Module):
    """Multi-head self-attention (one fused q/k/v projection, torch's scaled_dot_product_attention)."""

    def __init__(self, dim: int, num_heads: int, dropout: float = 0.0):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"HIDDEN_SIZE={dim} must be divisible by NUM_HEADS={num_heads}")
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        q, k, v = self.qkv(x).view(batch, tokens, 3, self.num_heads, dim // self.num_heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(attended.transpose(1, 2).reshape(batch, tokens, dim))


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, dropout: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attention = Attention(dim, num_heads, dropout)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, dim),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(TTModel):
    """ViT classifier: patch embedding, class token, learned position embedding, pre-norm blocks, linear head.

    Args:
        image_size: input height and width (square images).
        patch_size: patch height and width; must divide ``image_size``.
        num_classes: outputs of the head.
        hidden_size: token width.
        depth: number of transformer blocks.
        num_heads: attention heads per block.
        mlp_ratio: MLP width relative to ``hidden_size``.
        dropout: dropout in attention and MLP.
    """

    def __init__(self, image_size: int, patch_size: int, num_classes: int, hidden_size: int, depth: int,
                 num_heads: int, mlp_ratio: float = 4.0, dropout: float = 0.0):
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"PATCH_SIZE={patch_size} must divide IMAGE_SIZE={image_size}")
        num_patches = (image_size // patch_size) ** 2
        self.patch_embed = nn.Conv2d(3, hidden_size, kernel_size=patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, hidden_size))
        self.pos_embed = nn.Parameter(torch.randn(1, num_patches + 1, hidden_size) * 0.02)
        self.blocks = nn.Sequential(*(Block(hidden_size, num_heads, mlp_ratio, dropout) for _ in range(depth)))
        self.norm = nn.LayerNorm(hidden_size)
        self.head = nn.Linear(hidden_size, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        tokens = self.patch_embed(images).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls_token.expand(tokens.size(0), -1, -1), tokens], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(tokens))[:, 0])

    def get_loss(self, batch_data, criterion, device):
        images, labels = batch_data
        return criterion(self(images.to(device)), labels.to(device))

    def get_predictions(self, batch_data, device):
        images, labels = batch_data
        return self(images.to(device)).argmax(dim=1).cpu(), labels, None


def synthetic_images(num_samples: int, num_classes: int, image_size: int, seed: int, split: int,
                     noise: float = 1.0) -> TensorDataset:
    """``num_samples`` noisy copies of per-class prototype images.

    The prototypes depend on ``seed`` alone; the samples on ``seed`` and ``split`` (0: train, 1: test).
    """
    generator = torch.Generator().manual_seed(seed)
    coarse = torch.randn(num_classes, 3, max(image_size // 8, 1), max(image_size // 8, 1), generator=generator)
    prototypes = F.interpolate(coarse, size=(image_size, image_size), mode="bilinear", align_corners=False)
    # The samples draw from their own stream, so the train and test sets share the prototypes only.
    sample_generator = torch.Generator().manual_seed(1_000_003 * (split + 1) + seed)
    labels = torch.randint(0, num_classes, (num_samples,), generator=sample_generator)
    images = prototypes[labels] + noise * torch.randn(num_samples, 3, image_size, image_size,
                                                      generator=sample_generator)
    return TensorDataset(images, labels)


def synthetic_loaders(config: dict, seed: int = 0) -> Tuple[DataLoader, DataLoader]:
    """Train and test loaders of the configuration's sizes."""
    train_set = synthetic_images(config["NUM_TRAIN_SAMPLES"], config["NUM_CLASSES"], config["IMAGE_SIZE"], seed, 0)
    test_set = synthetic_images(config["NUM_TEST_SAMPLES"], config["NUM_CLASSES"], config["IMAGE_SIZE"], seed, 1)
    train_loader = DataLoader(train_set, batch_size=config["BATCH_SIZE"], shuffle=True,
                              generator=torch.Generator().manual_seed(seed))
    test_loader = DataLoader(test_set, batch_size=config["BATCH_SIZE"], shuffle=False)
    return train_loader, test_loader


def build_model(config: dict) -> VisionTransformer:
    return VisionTransformer(config["IMAGE_SIZE"], config["PATCH_SIZE"], config["NUM_CLASSES"],
                             config["HIDDEN_SIZE"], config["DEPTH"], config["NUM_HEADS"],
                             config.get("MLP_RATIO", 4.0), config.get("DROPOUT", 0.0))
