"""Quickstart: train a small CNN on scikit-learn's bundled handwritten digits (no download needed).

Run:  python examples/quickstart.py            (about 10 s on 2 CPU cores)
      python examples/quickstart.py --epochs 30 --no-amp

The best epoch's checkpoint (by validation accuracy) is kept in ./aitoolbox_runs/run_<timestamp>/checkpoint_model/,
and the test accuracy is that of the best model.
"""
import argparse

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from aitoolbox.experiment.result_package.basic_packages import ClassificationResultPackage
from aitoolbox.torchtrain.callbacks import ModelCheckpoint, ModelPerformanceEvaluation, ModelPerformancePrintReport
from aitoolbox.torchtrain.model import TTModel
from aitoolbox.torchtrain.train_loop import TrainLoop


class DigitsCNN(TTModel):
    """Two convolutions and a classifier head for 8x8 grey-scale digits."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, kernel_size=3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, kernel_size=3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Dropout(0.25), nn.Linear(128, num_classes),
        )

    def forward(self, images):
        return self.classifier(self.features(images))

    def get_loss(self, batch_data, criterion, device):
        images, labels = batch_data
        return criterion(self(images.to(device)), labels.to(device))

    def get_predictions(self, batch_data, device):
        images, labels = batch_data
        return self(images.to(device)).argmax(dim=1).cpu(), labels, None


def digits_loaders(batch_size: int, seed: int):
    """Train/validation/test loaders over the 1,797 digits (70/15/15, stratified)."""
    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    labels = torch.tensor(digits.target, dtype=torch.long)
    idx_train, idx_rest = train_test_split(range(len(labels)), test_size=0.3, stratify=labels, random_state=seed)
    idx_val, idx_test = train_test_split(idx_rest, test_size=0.5, stratify=labels[idx_rest], random_state=seed)

    def loader(indices, shuffle):
        dataset = TensorDataset(images[indices], labels[indices])
        return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle,
                          generator=torch.Generator().manual_seed(seed))

    return loader(idx_train, True), loader(idx_val, False), loader(idx_test, False)


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-amp", action="store_true", help="train in float32 instead of mixed precision")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    train_loader, val_loader, test_loader = digits_loaders(args.batch_size, args.seed)
    model = DigitsCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    tl = TrainLoop(model, train_loader, val_loader, test_loader, optimizer, nn.CrossEntropyLoss(),
                   use_amp=not args.no_amp, show_progress=not args.no_progress)
    # Keeps the best epoch's checkpoint by validation accuracy (and the newest one, to resume from).
    checkpoint = ModelCheckpoint(rm_subopt_local_models="val_Accuracy", num_best_checkpoints_kept=1)
    tl.fit(num_epochs=args.epochs, callbacks=[
        ModelPerformanceEvaluation(ClassificationResultPackage(), args=vars(args), on_val_data=True),
        ModelPerformancePrintReport(["val_Accuracy"]),
        checkpoint,
    ])

    print(f"Best checkpoint: {checkpoint.best_model_path} (val_Accuracy {checkpoint.best_model_score:.4f})")
    model = checkpoint.load_best_model()  # the best epoch's weights, in the TrainLoop's model
    y_pred, y_true, _ = tl.predict_on_test_set()
    test_accuracy = ClassificationResultPackage().prepare_result_package(y_true, y_pred).get_results()["Accuracy"]
    print(f"Test accuracy of the best model: {test_accuracy:.4f} ({len(y_true)} digits)")
    return test_accuracy


if __name__ == "__main__":
    main()
