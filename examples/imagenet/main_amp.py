"""Mixed precision ImageNet training with the apex ``amp`` API, written as a plain PyTorch loop.

Migrating an apex script is one import line: ``from apex import amp`` becomes
``from aitoolbox.torchtrain import amp`` and ``from apex.parallel import ...`` becomes
``from aitoolbox.torchtrain.parallel import ...``. The three amp lines are unchanged::

    model, optimizer = amp.initialize(model, optimizer, opt_level=..., keep_batchnorm_fp32=..., loss_scale=...)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()

Examples (see README.md for all of them)::

    python main_amp.py -a resnet50 --b 224 --workers 4 --opt-level O1 /data/imagenet
    python -m torch.distributed.run --nproc_per_node=2 main_amp.py -a resnet50 --b 224 --opt-level O1 /data/imagenet
    python main_amp.py -a resnet_tiny --b 8 --workers 0 --image-size 32 --opt-level O1 --epochs 1 /tmp/tiny

Without a GPU everything runs on the CPU, where the low-precision type is bfloat16, and several processes
train over gloo.
"""
import argparse
import collections
import os
import random
import shutil
import time
from typing import List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

from aitoolbox.torchtrain import amp
from aitoolbox.torchtrain.parallel import DistributedDataParallel as DDP
from aitoolbox.torchtrain.parallel import convert_syncbn_model
from image_data import DataPrefetcher, FakeImages, ImageFolder, train_transform, val_transform
from models import available_architectures, build_model


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", metavar="DIR", nargs="?",
                        help="path to the dataset: DIR/train and DIR/val, one sub-folder per class")
    parser.add_argument("-a", "--arch", metavar="ARCH", default="resnet18", choices=available_architectures(),
                        help="model architecture: " + " | ".join(available_architectures()) + " (default: resnet18)")
    parser.add_argument("-j", "--workers", default=4, type=int, metavar="N", help="data loading workers (default 4)")
    parser.add_argument("--epochs", default=90, type=int, metavar="N", help="number of total epochs to run")
    parser.add_argument("--start-epoch", default=0, type=int, metavar="N", help="epoch number to start from")
    parser.add_argument("-b", "--b", "--batch-size", dest="batch_size", default=256, type=int, metavar="N",
                        help="mini-batch size per process (default 256)")
    parser.add_argument("--lr", "--learning-rate", default=0.1, type=float, metavar="LR",
                        help="learning rate for a global batch of 256; scaled by global batch / 256")
    parser.add_argument("--momentum", default=0.9, type=float, metavar="M", help="momentum")
    parser.add_argument("--weight-decay", "--wd", default=1e-4, type=float, metavar="W", help="weight decay")
    parser.add_argument("--print-freq", "-p", default=10, type=int, metavar="N", help="print frequency (iterations)")
    parser.add_argument("--resume", default="", type=str, metavar="PATH", help="path to a checkpoint to resume from")
    parser.add_argument("-e", "--evaluate", action="store_true", help="evaluate the model on the validation set")
    parser.add_argument("--checkpoint-dir", default=".", metavar="DIR",
                        help="where checkpoint.pth.tar and model_best.pth.tar are written (default: .)")
    parser.add_argument("--image-size", default=224, type=int, metavar="PIXELS", help="crop size (default 224)")
    parser.add_argument("--fake-data", action="store_true", help="train on random images generated in memory")
    parser.add_argument("--fake-classes", default=10, type=int, metavar="N", help="classes of --fake-data")
    parser.add_argument("--fake-samples", default=256, type=int, metavar="N",
                        help="training images of --fake-data (validation: a quarter as many)")
    parser.add_argument("--prof", default=-1, type=int, metavar="N",
                        help="profile N iterations with torch.profiler, print the table and stop")
    parser.add_argument("--deterministic", action="store_true",
                        help="seed everything and use deterministic algorithms: bitwise identical runs")
    parser.add_argument("--seed", default=None, type=int,
                        help="random seed (default: unseeded; 0 with --deterministic)")
    parser.add_argument("--local_rank", "--local-rank", dest="local_rank", default=int(os.environ.get("LOCAL_RANK", 0)),
                        type=int, help="set by torch.distributed.launch (torchrun sets LOCAL_RANK instead)")
    parser.add_argument("--sync_bn", action="store_true", help="synchronise BatchNorm statistics across processes")
    parser.add_argument("--opt-level", type=str, default="O1", help="amp optimization level: O0, O1, O2 or O3")
    parser.add_argument("--keep-batchnorm-fp32", type=str, default=None, help="'True' or 'False' (amp override)")
    parser.add_argument("--loss-scale", type=str, default=None, help="'dynamic' or a number such as 128.0")
    args = parser.parse_args(argv)
    if args.data is None and not args.fake_data:
        parser.error("give the dataset folder DIR, or --fake-data")
    return args


class AverageMeter:
    """The latest value and the running average of a statistic."""

    def __init__(self):
        self.value = self.sum = self.count = 0.0

    @property
    def average(self) -> float:
        return self.sum / max(self.count, 1)

    def update(self, value: float, n: int = 1) -> None:
        self.value = value
        self.sum += value * n
        self.count += n


def correct_counts(output: torch.Tensor, target: torch.Tensor, topk: Sequence[int]) -> List[torch.Tensor]:
    """How many rows have their target among the k highest outputs, for each k (k clipped to the classes)."""
    maxk = min(max(topk), output.size(1))
    _, predicted = output.topk(maxk, dim=1)
    hits = predicted.eq(target.view(-1, 1))
    return [hits[:, :min(k, maxk)].any(dim=1).sum().float() for k in topk]


def reduce_mean(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    reduced = tensor.clone()
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
    return reduced / world_size


def set_learning_rate(optimizer: torch.optim.Optimizer, base_lr: float, epoch: int, step: int,
                      steps_per_epoch: int) -> None:
    """Step decay (x0.1 at epochs 30, 60 and 80) after a linear warm-up over the first 5 epochs."""
    lr = base_lr * 0.1 ** sum(epoch >= boundary for boundary in (30, 60, 80))
    if epoch < 5:
        lr *= (1 + step + epoch * steps_per_epoch) / (5.0 * steps_per_epoch)
    for group in optimizer.param_groups:
        group["lr"] = lr


def make_deterministic(seed: int) -> None:
    """Seed every generator and make torch pick deterministic kernels (CUBLAS_WORKSPACE_CONFIG is set in main)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # warn_only: an operation without a deterministic implementation (torchvision's AdaptiveAvgPool2d backward
    # on CUDA, for one) warns instead of stopping the run; the built-in models avoid all such operations.
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


class Profiling:
    """Profiles iterations ``start .. start + count - 1`` of the first epoch with torch.profiler."""

    def __init__(self, count: int, steps_per_epoch: int, use_cuda: bool):
        self.count = count
        self.start = 1 if steps_per_epoch > count else 0  # leave the first (warm-up) iteration out if possible
        activities = [torch.profiler.ProfilerActivity.CPU]
        if use_cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=False)
        self.use_cuda = use_cuda
        self.done = False

    def before(self, step: int) -> None:
        if step == self.start:
            self.profiler.__enter__()

    def after(self, step: int, last_step: bool) -> None:
        if step == self.start + self.count - 1 or (last_step and step >= self.start):
            if self.use_cuda:
                torch.cuda.synchronize()
            self.profiler.__exit__(None, None, None)
            sort_by = "self_cuda_time_total" if self.use_cuda else "self_cpu_time_total"
            print(self.profiler.key_averages().table(sort_by=sort_by, row_limit=25))
            print(f"Profiling ended after {step - self.start + 1} iterations")
            self.done = True


def train(loader, model, criterion, optimizer, epoch: int, args, profiling: Optional[Profiling]) -> None:
    batch_time, losses, top1, top5 = AverageMeter(), AverageMeter(), AverageMeter(), AverageMeter()
    model.train()
    batches = DataPrefetcher(loader) if args.device.type == "cuda" else loader
    end, last_printed = time.time(), -1
    for step, (images, target) in enumerate(batches):
        if profiling is not None:
            profiling.before(step)
        set_learning_rate(optimizer, args.lr, epoch, step, len(loader))

        with torch.profiler.record_function("forward"):
            output = model(images)
            loss = criterion(output, target)
        optimizer.zero_grad()
        with torch.profiler.record_function("backward"):
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
        with torch.profiler.record_function("optimizer.step"):
            optimizer.step()

        last_step = step == len(loader) - 1
        if step % args.print_freq == 0 or last_step:
            # Reading the metrics waits for the device, so it only happens at print time.
            prec1, prec5 = (100.0 * count / target.size(0) for count in correct_counts(output.detach(), target, (1, 5)))
            reduced_loss = loss.detach()
            if args.distributed:
                reduced_loss, prec1, prec5 = (reduce_mean(t, args.world_size) for t in (reduced_loss, prec1, prec5))
            losses.update(reduced_loss.item(), images.size(0))
            top1.update(prec1.item(), images.size(0))
            top5.update(prec5.item(), images.size(0))
            if args.device.type == "cuda":
                torch.cuda.synchronize()
            batch_time.update((time.time() - end) / (step - last_printed), step - last_printed)
            end, last_printed = time.time(), step
            if args.rank == 0:
                speed = args.world_size * args.batch_size / max(batch_time.value, 1e-9)
                print(f"Epoch: [{epoch}][{step}/{len(loader)}]\t"
                      f"Time {batch_time.value:.3f} ({batch_time.average:.3f})\t"
                      f"Speed {speed:.3f} ({args.world_size * args.batch_size / max(batch_time.average, 1e-9):.3f})\t"
                      f"Loss {losses.value:.10f} ({losses.average:.4f})\t"
                      f"Prec@1 {top1.value:.3f} ({top1.average:.3f})\t"
                      f"Prec@5 {top5.value:.3f} ({top5.average:.3f})", flush=True)
        if profiling is not None:
            profiling.after(step, last_step)
            if profiling.done:
                return


@torch.no_grad()
def validate(loader, model, criterion, args) -> float:
    """Top-1 and top-5 accuracy over the whole validation set (each process evaluates its own share)."""
    module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    module.eval()
    totals = torch.zeros(4, dtype=torch.float64)  # loss sum, top-1 hits, top-5 hits, samples
    batches = DataPrefetcher(loader) if args.device.type == "cuda" else loader
    for images, target in batches:
        output = module(images)
        top1, top5 = correct_counts(output, target, (1, 5))
        totals += torch.stack([criterion(output, target).double().cpu() * target.size(0), top1.double().cpu(),
                               top5.double().cpu(), torch.tensor(float(target.size(0)), dtype=torch.float64)])
    if args.distributed:
        # Sums, not per-rank means: the shares may differ in size and the result is exact.
        totals = totals.to(args.device)
        dist.all_reduce(totals)
        totals = totals.cpu()
    loss, prec1, prec5 = (totals[:3] / totals[3].clamp(min=1)).tolist()
    if args.rank == 0:
        print(f" * Prec@1 {100 * prec1:.3f} Prec@5 {100 * prec5:.3f} Loss {loss:.4f} "
              f"({int(totals[3])} images)", flush=True)
    return 100 * prec1


def save_checkpoint(state: dict, is_best: bool, folder: str) -> None:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "checkpoint.pth.tar")
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)  # a crash while writing never leaves a truncated checkpoint
    if is_best:
        shutil.copyfile(path, os.path.join(folder, "model_best.pth.tar"))


def build_loaders(args, num_workers: int):
    if args.fake_data:
        train_set = FakeImages(args.fake_samples, args.fake_classes, args.image_size,
                               train_transform(args.image_size), seed=0)
        val_set = FakeImages(max(args.fake_samples // 4, 1), args.fake_classes, args.image_size,
                             val_transform(args.image_size), seed=1)
    else:
        train_set = ImageFolder(os.path.join(args.data, "train"), train_transform(args.image_size))
        val_set = ImageFolder(os.path.join(args.data, "val"), val_transform(args.image_size))
    train_sampler = DistributedSampler(train_set, seed=args.seed or 0) if args.distributed else None
    if args.distributed:
        val_set = Subset(val_set, range(args.rank, len(val_set), args.world_size))  # unpadded share
    pin = args.device.type == "cuda"
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=train_sampler is None,
                              sampler=train_sampler, num_workers=num_workers, pin_memory=pin)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, shuffle=False, num_workers=num_workers,
                            pin_memory=pin)
    return train_loader, val_loader, train_sampler, len(train_set.classes)


def main(argv: Optional[Sequence[str]] = None) -> float:
    args = parse_args(argv)
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS: set before CUDA starts
    args.world_size = int(os.environ.get("WORLD_SIZE", 1))
    args.distributed = args.world_size > 1
    use_cuda = torch.cuda.is_available()
    if args.distributed:
        # torchrun sets LOCAL_RANK; torch.distributed.launch passes --local-rank (or LOCAL_RANK with --use-env).
        if use_cuda:
            torch.cuda.set_device(args.local_rank % torch.cuda.device_count())
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", init_method="env://")
        args.world_size = dist.get_world_size()
    best_prec1 = run(args, use_cuda)
    if args.distributed:
        # Leave together: a rank tearing down gloo while its peer is still saving can abort the peer.
        dist.barrier()
        dist.destroy_process_group()
    return best_prec1


def run(args: argparse.Namespace, use_cuda: bool) -> float:
    """Everything after joining the process group: build, train, validate, save. Returns the best top-1."""
    args.rank = dist.get_rank() if args.distributed else 0
    args.device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    if args.deterministic:
        args.seed = 0 if args.seed is None else args.seed
    if args.seed is not None:
        if args.deterministic:
            make_deterministic(args.seed + args.rank)
        else:
            torch.manual_seed(args.seed + args.rank)

    if args.rank == 0:
        print(f"opt_level = {args.opt_level}, keep_batchnorm_fp32 = {args.keep_batchnorm_fp32}, "
              f"loss_scale = {args.loss_scale}, device = {args.device.type}, world_size = {args.world_size}")
        if use_cuda:
            print(f"CUDNN VERSION: {torch.backends.cudnn.version()}")
    torch.backends.cudnn.benchmark = not args.deterministic

    train_loader, val_loader, train_sampler, num_classes = build_loaders(args, args.workers)

    model = build_model(args.arch, num_classes)
    if args.sync_bn:
        if args.rank == 0:
            print("using synchronized batch normalization")
        model = convert_syncbn_model(model)
    model = model.to(args.device)

    # The learning rate is given for a global batch of 256.
    args.lr = args.lr * float(args.batch_size * args.world_size) / 256.0
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.weight_decay)

    # amp.initialize must come before the DistributedDataParallel wrap.
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level,
                                      keep_batchnorm_fp32=args.keep_batchnorm_fp32, loss_scale=args.loss_scale)
    if args.rank == 0:
        dtypes = collections.Counter(str(param.dtype).replace("torch.", "") for param in model.parameters())
        print("parameter dtypes after amp.initialize: " + ", ".join(f"{n} {d}" for d, n in sorted(dtypes.items())))
    if args.distributed:
        # delay_allreduce: one all-reduce after the backward pass (apex's example setting).
        model = DDP(model, delay_allreduce=True)
    criterion = nn.CrossEntropyLoss().to(args.device)

    best_prec1 = 0.0
    if args.resume:
        if not os.path.isfile(args.resume):
            raise FileNotFoundError(f"no checkpoint found at {args.resume!r}")
        checkpoint = torch.load(args.resume, map_location=args.device, weights_only=True)
        args.start_epoch = checkpoint["epoch"]
        best_prec1 = checkpoint["best_prec1"]
        unwrapped(model).load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        amp.load_state_dict(checkpoint["amp"])
        if args.rank == 0:
            print(f"=> loaded checkpoint '{args.resume}' (epoch {checkpoint['epoch']})")

    if args.evaluate:
        return validate(val_loader, model, criterion, args)

    profiling = Profiling(args.prof, len(train_loader), use_cuda) if args.prof > 0 else None
    for epoch in range(args.start_epoch, args.epochs):
        if train_sampler is not None:
            train_sampler.set_epoch(epoch)
        epoch_start = time.time()
        train(train_loader, model, criterion, optimizer, epoch, args, profiling)
        if profiling is not None and profiling.done:
            return best_prec1
        prec1 = validate(val_loader, model, criterion, args)
        if args.rank == 0:
            is_best = prec1 > best_prec1 or epoch == args.start_epoch and best_prec1 == 0.0
            best_prec1 = max(prec1, best_prec1)
            save_checkpoint({"epoch": epoch + 1, "arch": args.arch, "state_dict": unwrapped(model).state_dict(),
                             "best_prec1": best_prec1, "optimizer": optimizer.state_dict(), "amp": amp.state_dict()},
                            is_best, args.checkpoint_dir)
            print(f"Epoch {epoch} done in {time.time() - epoch_start:.1f}s; best Prec@1 {best_prec1:.3f}", flush=True)
    return best_prec1


def unwrapped(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


if __name__ == "__main__":
    main()
