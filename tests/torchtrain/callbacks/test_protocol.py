"""TrainLoop offers what TrainLoopView promises callbacks, and the package's callbacks use nothing else."""
import ast
import inspect
import pathlib

import torch
from torch import nn

import aitoolbox
from aitoolbox.torchtrain.callbacks.protocol import TRAIN_LOOP_VIEW_MEMBERS, TrainLoopView
from aitoolbox.torchtrain.train_loop import TrainLoop
from tests.helpers import MLP, classification_data, seeded_loader

PACKAGE_ROOT = pathlib.Path(aitoolbox.__file__).parent
# Loop infrastructure rather than callbacks: the handler registers callbacks for the loop's process rank.
NOT_CALLBACKS = {"handler.py", "protocol.py"}


def test_train_loop_satisfies_the_view():
    model = MLP()
    tl = TrainLoop(model, seeded_loader(classification_data(16), 8), None, None,
                   torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), show_progress=False)
    tl.fit(num_epochs=1)  # precision and amp_scaler exist once set up
    assert isinstance(tl, TrainLoopView)
    for name in TRAIN_LOOP_VIEW_MEMBERS:
        member = getattr(TrainLoopView, name, None)
        if callable(member) and not isinstance(member, property):
            ours = inspect.signature(getattr(tl, name))
            promised = inspect.signature(member)
            assert list(ours.parameters) == [p for p in promised.parameters if p != "self"], name


def loop_attributes_used(path: pathlib.Path):
    """``(line, name)`` of every attribute read or written on ``self.train_loop_obj`` or a local alias of it."""
    tree = ast.parse(path.read_text())

    def is_loop(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "train_loop_obj" \
            and isinstance(node.value, ast.Name) and node.value.id == "self"

    aliases = {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign) and is_loop(node.value)
               for target in node.targets if isinstance(target, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (is_loop(node.value) or (
                isinstance(node.value, ast.Name) and node.value.id in aliases)):
            yield node.lineno, node.attr


def test_package_callbacks_use_only_the_view():
    folders = [PACKAGE_ROOT / "torchtrain" / "callbacks", PACKAGE_ROOT / "torchtrain" / "schedulers"]
    outside = [f"{path.name}:{line} .{name}" for folder in folders for path in sorted(folder.glob("*.py"))
               if path.name not in NOT_CALLBACKS for line, name in loop_attributes_used(path)
               if name not in TRAIN_LOOP_VIEW_MEMBERS]
    assert outside == []
