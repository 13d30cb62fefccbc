"""Mixed precision training on one device with the apex ``amp`` API.

The apex recipe, unchanged except for the import line (``from apex import amp`` becomes
``from aitoolbox.torchtrain import amp``): move the model to its device, call ``amp.initialize`` on the
model and optimizer, and hand both to a TrainLoop with ``use_amp=True``. The TrainLoop then runs every
forward pass, loss scaling and optimizer step the way ``amp.initialize`` configured them.

On a CUDA GPU O1 computes in float16 with dynamic loss scaling; on a CPU it computes in bfloat16.

Run:  python examples/amp_training/single_device_training.py
      python examples/amp_training/single_device_training.py --epochs 3 --opt-level O2
"""
import argparse

import torch
from torch import nn, optim

from aitoolbox.torchtrain import amp
from aitoolbox.torchtrain.train_loop import TrainLoop
from digits_cnn import CNNModel, accuracy, digits_loaders


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10, help="number of training epochs (default 10)")
    parser.add_argument("--batch-size", type=int, default=64, help="batch size (default 64)")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 0.001)")
    parser.add_argument("--opt-level", default="O1", choices=["O0", "O1", "O2", "O3"],
                        help="apex optimization level (default O1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train_loader, val_loader, test_loader = digits_loaders(args.batch_size, args.seed)

    model = CNNModel().to(device)  # the model goes to its device before amp.initialize
    optimizer = optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
    criterion = nn.NLLLoss().to(device)

    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level)

    tl = TrainLoop(model, train_loader, val_loader, test_loader, optimizer, criterion,
                   use_amp=True, show_progress=not args.no_progress)
    model = tl.fit(num_epochs=args.epochs)

    y_pred, y_true, _ = tl.predict_on_test_set()
    test_accuracy = accuracy(y_pred, y_true)
    print(f"Test accuracy: {test_accuracy:.4f} (opt_level {args.opt_level}, {len(y_true)} test digits, "
          f"device {device.type})")
    return test_accuracy


if __name__ == "__main__":
    main()
