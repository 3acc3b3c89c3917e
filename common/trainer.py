"""Everything a run does once its processes and devices exist.

A script sets up its launch mode (process group, device, Runtime), builds a
Trainer (data sharded by rank, bare model on the device, optimizer, resumed
state), wraps `trainer.model` its own way (DataParallel or
DistributedDataParallel), and calls `trainer.fit(train_model, eval_model)`.
"""
import random
import time

import torch
import torch.nn as nn

from . import checkpoint, distributed
from .args import UsageError, default_output_dir
from .data import build_data
from .engine import evaluate, train_one_epoch
from .logger import RunLogger, describe_environment
from .models import build_model
from .schedule import build_scheduler


def per_process_batch(batch_size, world_size):
    """-b is the global batch: each of the world_size processes takes an equal share."""
    if batch_size % world_size:
        raise UsageError(f"--batch-size {batch_size} is the global batch and must divide evenly "
                         f"over {world_size} processes: use a multiple of {world_size}")
    return batch_size // world_size


class Trainer:
    def __init__(self, args, runtime):
        self.args, self.runtime = args, runtime
        device = runtime.device
        distributed.check_sync_bn(args.sync_bn, device)
        args.output_dir = args.output_dir or default_output_dir(args, runtime.mode)
        resume_path = checkpoint.resolve_resume(args.resume, args.output_dir)
        resumed = checkpoint.load_checkpoint(resume_path) if resume_path else None

        # The same seed on every rank: same initial weights and same data order.
        seed = args.seed if args.seed is not None else (resumed or {}).get("seed")
        self.seed = distributed.shared_seed(seed)
        random.seed(self.seed)
        torch.manual_seed(self.seed)
        # cudnn picks the fastest kernels unless a seed asks for repeatable ones.
        torch.backends.cudnn.benchmark = args.seed is None
        torch.backends.cudnn.deterministic = args.seed is not None

        batch = per_process_batch(args.batch_size, runtime.world_size)
        self.data = build_data(args, self.seed, runtime.rank, runtime.world_size, batch,
                               pin_memory=device.type == "cuda")
        model = build_model(args.arch, len(self.data.classes), args.pretrained, args.dropout)
        if resumed:
            checkpoint.load_weights(model, resumed, args.arch, self.data.classes, resume_path)
        if args.sync_bn:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        memory_format = torch.channels_last if args.channels_last else torch.preserve_format
        self.model = model.to(device, memory_format=memory_format)

        self.criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing).to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=args.momentum,
                                         weight_decay=args.weight_decay)
        self.scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
        self.start_epoch, self.best_acc1 = 0, 0.0
        if resumed and not args.evaluate:
            self.start_epoch = int(resumed.get("epoch", 0))
            self.best_acc1 = float(resumed.get("best_acc1", 0.0))
            if "optimizer" in resumed:
                self.optimizer.load_state_dict(resumed["optimizer"])
            if resumed.get("scaler"):
                self.scaler.load_state_dict(resumed["scaler"])
        steps_per_epoch = len(self.data.train_loader)
        self.scheduler = build_scheduler(self.optimizer, args, steps_per_epoch,
                                         start_step=self.start_epoch * steps_per_epoch)
        self.resume_path = resume_path if resumed else None
        self.resumed_epoch = int(resumed.get("epoch", 0)) if resumed else 0
        self.log = RunLogger(args.output_dir, prints=runtime.is_main,
                             writes=runtime.writes_checkpoints(args.save_on))

    def _state(self, epoch):
        return {"epoch": epoch, "arch": self.args.arch, "num_classes": len(self.data.classes),
                "classes": list(self.data.classes), "seed": self.seed,
                "state_dict": checkpoint.unwrap(self.model).state_dict(),
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(), "best_acc1": self.best_acc1,
                "args": {key: value for key, value in vars(self.args).items()}}

    def fit(self, train_model, eval_model):
        """Train from the start (or resumed) epoch to --epochs, evaluating and checkpointing each epoch."""
        args, runtime, log = self.args, self.runtime, self.log
        if args.compile:
            train_model, eval_model = torch.compile(train_model), torch.compile(eval_model)
        log.print(f"{runtime.mode}: world size {runtime.world_size}, {runtime.num_devices} device(s) per process, "
                  f"{describe_environment(runtime.device, runtime.num_devices)}")
        log.print(f"data: {args.data or 'synthetic (--dummy)'} ({len(self.data.classes)} classes, "
                  f"{len(self.data.train_loader.dataset)} train / {len(self.data.val_loader.dataset)} val images)")
        if self.resume_path:
            log.print(f"resumed from {self.resume_path} (epoch {self.resumed_epoch})")
        if args.evaluate:
            evaluate(eval_model, self.criterion, self.data.val_loader, runtime.device, args, log.print)
            return
        if self.start_epoch >= args.epochs:
            log.print(f"already trained {self.start_epoch} of --epochs {args.epochs}: nothing to do")
            return
        log.print(f"output: {args.output_dir}")
        log.start(args, resumed=self.resume_path is not None)
        wall_start = time.time()
        val = {"acc1": 0.0, "acc5": 0.0, "loss": float("nan")}
        train = {"images_per_second": 0.0}
        for epoch in range(self.start_epoch, args.epochs):
            # A new shuffle every epoch, the same on every rank; also reseeds augmentation.
            self.data.train_sampler.set_epoch(epoch)
            if hasattr(self.data.train_loader.dataset, "set_epoch"):
                self.data.train_loader.dataset.set_epoch(epoch)
            epoch_start, lr = time.time(), self.optimizer.param_groups[0]["lr"]
            train = train_one_epoch(train_model, self.criterion, self.optimizer, self.scheduler, self.scaler,
                                    self.data.train_loader, runtime.device, epoch, args, log.print)
            # BatchNorm statistics drift apart across ranks; evaluate and save rank 0's.
            distributed.broadcast_buffers(self.model)
            val = evaluate(eval_model, self.criterion, self.data.val_loader, runtime.device, args, log.print)
            is_best = val["acc1"] > self.best_acc1
            self.best_acc1 = max(val["acc1"], self.best_acc1)
            if runtime.writes_checkpoints(args.save_on):
                checkpoint.save_checkpoint(self._state(epoch + 1), args.output_dir, is_best)
            log.log_epoch({"epoch": epoch, "start_time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(epoch_start)),
                           "seconds": round(time.time() - epoch_start, 3), "lr": lr,
                           "train_loss": train["loss"], "train_acc1": train["acc1"], "val_loss": val["loss"],
                           "val_acc1": val["acc1"], "val_acc5": val["acc5"],
                           "images_per_second": round(train["images_per_second"], 1)})
        summary = {"mode": runtime.mode, "arch": args.arch, "epochs": args.epochs, "world_size": runtime.world_size,
                   "devices_per_process": runtime.num_devices, "device": str(runtime.device),
                   "best_acc1": self.best_acc1, "final_acc1": val["acc1"], "final_acc5": val["acc5"],
                   "final_val_loss": val["loss"], "train_images_per_second": train["images_per_second"],
                   "wall_seconds": round(time.time() - wall_start, 2), "torch": torch.__version__}
        log.finish(summary)
        log.print(f"done: best acc@1 {self.best_acc1:.2f}, final acc@1 {val['acc1']:.2f} "
                  f"in {summary['wall_seconds']:.0f} s; outputs in {args.output_dir}")
        return summary
