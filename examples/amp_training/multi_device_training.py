"""Mixed precision DistributedDataParallel training: one process per GPU, or CPU processes without CUDA.

With ``fit_distributed`` the TrainLoop does the AMP set-up itself: it starts one process per device, and in
each one moves the model to its device, calls ``amp.initialize(model, optimizer, **amp_init_args)`` and only
then wraps the model in DistributedDataParallel (the order apex requires). The script passes the plain model
and optimizer; nothing apex-specific is imported.

Without a GPU (``torch.cuda.device_count() == 0``) ``--cpu-processes`` processes train over gloo, so the
example also runs on a laptop.

Run:  python examples/amp_training/multi_device_training.py
      python examples/amp_training/multi_device_training.py --epochs 3 --cpu-processes 2
"""
import argparse

import torch
from torch import nn, optim

from aitoolbox.torchtrain.train_loop import TrainLoop
from digits_cnn import CNNModel, accuracy, digits_loaders


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10, help="number of training epochs (default 10)")
    parser.add_argument("--batch-size", type=int, default=64, help="per-process batch size (default 64)")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 0.001)")
    parser.add_argument("--opt-level", default="O1", choices=["O0", "O1", "O2", "O3"],
                        help="apex optimization level (default O1)")
    parser.add_argument("--cpu-processes", type=int, default=2,
                        help="number of processes when there is no GPU (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    train_loader, val_loader, test_loader = digits_loaders(args.batch_size, args.seed)

    model = CNNModel()  # stays on the CPU here: every process places its own copy
    optimizer = optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
    criterion = nn.NLLLoss()

    tl = TrainLoop(model, train_loader, val_loader, test_loader, optimizer, criterion,
                   use_amp=True, show_progress=not args.no_progress)
    model = tl.fit_distributed(num_epochs=args.epochs,
                               amp_init_args={"opt_level": args.opt_level},
                               num_nodes=1, node_rank=0, num_gpus=torch.cuda.device_count(),
                               num_cpu_processes=args.cpu_processes)

    # Back in this (launching) process the TrainLoop holds rank 0's trained weights and history.
    y_pred, y_true, _ = tl.predict_on_test_set()
    test_accuracy = accuracy(y_pred, y_true)
    processes = torch.cuda.device_count() or args.cpu_processes
    print(f"Test accuracy: {test_accuracy:.4f} (opt_level {args.opt_level}, {processes} processes, "
          f"{len(y_true)} test digits)")
    return test_accuracy


if __name__ == "__main__":
    main()
