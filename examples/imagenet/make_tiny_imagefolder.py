"""Write a tiny ImageFolder data set (``DIR/train/<class>/*.png`` and ``DIR/val/<class>/*.png``) for trying
``main_amp.py`` without ImageNet.

Each class has its own base colour plus noise, so a model can learn something in a few iterations.

Run:  python examples/imagenet/make_tiny_imagefolder.py /tmp/tiny_imagenet
      python examples/imagenet/main_amp.py -a resnet_tiny --b 8 --workers 0 --image-size 32 --epochs 1 \
          /tmp/tiny_imagenet
"""
import argparse
import os

import torch
from PIL import Image


def make_tiny_imagefolder(root: str, num_classes: int = 3, train_per_class: int = 8, val_per_class: int = 4,
                          size: int = 32, seed: int = 0) -> str:
    """Write the PNG files and return ``root``."""
    generator = torch.Generator().manual_seed(seed)
    base_colours = torch.randint(40, 216, (num_classes, 3), generator=generator)
    for split, per_class in (("train", train_per_class), ("val", val_per_class)):
        for label in range(num_classes):
            folder = os.path.join(root, split, f"class_{label:02d}")
            os.makedirs(folder, exist_ok=True)
            for index in range(per_class):
                noise = torch.randint(-40, 41, (size, size, 3), generator=generator)
                pixels = (base_colours[label] + noise).clamp(0, 255).to(torch.uint8)
                Image.fromarray(pixels.numpy(), mode="RGB").save(os.path.join(folder, f"{index:04d}.png"))
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", help="folder to write (created if missing)")
    parser.add_argument("--classes", type=int, default=3)
    parser.add_argument("--train-per-class", type=int, default=8)
    parser.add_argument("--val-per-class", type=int, default=4)
    parser.add_argument("--size", type=int, default=32, help="image width and height in pixels")
    args = parser.parse_args()
    make_tiny_imagefolder(args.root, args.classes, args.train_per_class, args.val_per_class, args.size)
    total = args.classes * (args.train_per_class + args.val_per_class)
    print(f"wrote {total} images of {args.size}x{args.size} in {args.classes} classes under {args.root}")


if __name__ == "__main__":
    main()
