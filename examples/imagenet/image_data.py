"""Image data for the ImageNet example without torchvision: an ImageFolder reader, the standard transforms,
an in-memory fake data set, and the CUDA prefetcher.

Random choices in the transforms draw from torch's generator, which the DataLoader seeds per worker from
the main process's seed: with ``--deterministic`` two runs see the same crops and flips.
"""
import math
import os
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from PIL import Image
from torch.utils.data import Dataset

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class ImageFolder(Dataset):
    """Images stored as ``root/<class name>/<image file>``; labels are the sorted class names' indices.

    Args:
        root: the folder holding one sub-folder per class.
        transform: applied to each RGB PIL image.
    """

    def __init__(self, root: str, transform: Optional[Callable] = None):
        if not os.path.isdir(root):
            raise FileNotFoundError(f"image folder {root!r} does not exist; it must hold one sub-folder per class")
        self.root = root
        self.classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
        if not self.classes:
            raise FileNotFoundError(f"no class folders in {root!r}; expected {root}/<class name>/<image files>")
        self.samples: List[Tuple[str, int]] = []
        for label, name in enumerate(self.classes):
            for folder, _, files in sorted(os.walk(os.path.join(root, name))):
                self.samples.extend((os.path.join(folder, file), label) for file in sorted(files)
                                    if file.lower().endswith(IMAGE_EXTENSIONS))
        if not self.samples:
            raise FileNotFoundError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) under {root!r}")
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        with Image.open(path) as image:
            image = image.convert("RGB")
        return (self.transform(image) if self.transform else image), label


class FakeImages(Dataset):
    """``num_samples`` random RGB images of one size and random labels, generated once from ``seed``.

    The images are PIL images, so the usual transforms (crops, flips) apply.
    """

    def __init__(self, num_samples: int, num_classes: int, image_size: int, transform: Optional[Callable] = None,
                 seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.pixels = torch.randint(0, 256, (num_samples, image_size, image_size, 3), dtype=torch.uint8,
                                    generator=generator)
        self.labels = torch.randint(0, num_classes, (num_samples,), generator=generator).tolist()
        self.classes = [f"class{index}" for index in range(num_classes)]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        image = Image.fromarray(self.pixels[index].numpy(), mode="RGB")
        return (self.transform(image) if self.transform else image), self.labels[index]


# --- transforms -----------------------------------------------------------------------------------------
class Compose:
    def __init__(self, transforms: Sequence[Callable]):
        self.transforms = list(transforms)

    def __call__(self, item):
        for transform in self.transforms:
            item = transform(item)
        return item


class RandomResizedCrop:
    """A crop of random area (``scale`` of the image) and aspect ratio, resized to ``size`` x ``size``."""

    def __init__(self, size: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), attempts: int = 10):
        self.size, self.scale, self.ratio, self.attempts = size, scale, ratio, attempts

    def __call__(self, image: Image.Image) -> Image.Image:
        width, height = image.size
        area = width * height
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(self.attempts):
            target_area = area * _uniform(*self.scale)
            aspect = math.exp(_uniform(*log_ratio))
            crop_w = int(round(math.sqrt(target_area * aspect)))
            crop_h = int(round(math.sqrt(target_area / aspect)))
            if 0 < crop_w <= width and 0 < crop_h <= height:
                left = int(torch.randint(0, width - crop_w + 1, ()).item())
                top = int(torch.randint(0, height - crop_h + 1, ()).item())
                return image.resize((self.size, self.size), Image.BILINEAR,
                                    box=(left, top, left + crop_w, top + crop_h))
        # No valid random crop found: fall back to a central crop of the image's own aspect ratio.
        return CenterCrop(self.size)(Resize(self.size)(image))


class Resize:
    """Scale the shorter side to ``size``, keeping the aspect ratio."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, image: Image.Image) -> Image.Image:
        width, height = image.size
        if width <= height:
            new_size = (self.size, max(1, int(round(height * self.size / width))))
        else:
            new_size = (max(1, int(round(width * self.size / height))), self.size)
        return image.resize(new_size, Image.BILINEAR)


class CenterCrop:
    def __init__(self, size: int):
        self.size = size

    def __call__(self, image: Image.Image) -> Image.Image:
        width, height = image.size
        left, top = (width - self.size) // 2, (height - self.size) // 2
        return image.crop((left, top, left + self.size, top + self.size))


class RandomHorizontalFlip:
    def __init__(self, probability: float = 0.5):
        self.probability = probability

    def __call__(self, image: Image.Image) -> Image.Image:
        if torch.rand(()).item() < self.probability:
            return image.transpose(Image.FLIP_LEFT_RIGHT)
        return image


def to_tensor(image: Image.Image) -> torch.Tensor:
    """RGB PIL image -> float32 tensor ``(3, H, W)`` in [0, 1]."""
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    return pixels.view(image.size[1], image.size[0], 3).permute(2, 0, 1).float().div_(255)


class Normalize:
    def __init__(self, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD):
        self.mean = torch.tensor(mean).view(3, 1, 1)
        self.std = torch.tensor(std).view(3, 1, 1)

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return (tensor - self.mean) / self.std


def _uniform(low: float, high: float) -> float:
    return low + (high - low) * torch.rand(()).item()


def train_transform(crop_size: int) -> Compose:
    """ImageNet training augmentation: random resized crop, horizontal flip, tensor, normalisation."""
    return Compose([RandomResizedCrop(crop_size), RandomHorizontalFlip(), to_tensor, Normalize()])


def val_transform(crop_size: int) -> Compose:
    """ImageNet evaluation: resize the shorter side to crop_size / 0.875, take the central crop."""
    return Compose([Resize(int(round(crop_size / 0.875))), CenterCrop(crop_size), to_tensor, Normalize()])


class DataPrefetcher:
    """Copies the next batch to the GPU on a side stream while the current one trains (CUDA only).

    Iterating yields ``(images, target)`` already on the current CUDA device.
    """

    def __init__(self, loader):
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        stream = torch.cuda.Stream()
        batches = iter(self.loader)

        def preload():
            try:
                images, target = next(batches)
            except StopIteration:
                return None
            with torch.cuda.stream(stream):
                return images.cuda(non_blocking=True), target.cuda(non_blocking=True)

        upcoming = preload()
        while upcoming is not None:
            torch.cuda.current_stream().wait_stream(stream)
            images, target = upcoming
            # The tensors were made on the side stream: tell the allocator the main stream uses them too.
            images.record_stream(torch.cuda.current_stream())
            target.record_stream(torch.cuda.current_stream())
            upcoming = preload()
            yield images, target
