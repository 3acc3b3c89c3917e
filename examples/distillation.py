"""Knowledge distillation from a trained teacher: `--trainer examples.distillation:Distillation`.

    python train_dp.py -a resnet18 --trainer examples.distillation:Distillation \
        --teacher runs/dp-resnet50-imagenet/model_best.pth --teacher-arch resnet50

One file of your own: a Trainer subclass that adds its flags, builds the teacher beside the student, and
replaces train_step. The loss is (1 - alpha) x cross-entropy + alpha x T^2 x KL(teacher || student) at
temperature T (Hinton et al. 2015); both terms are logged by name (train_ce_loss, train_distill_loss in
log.csv and TensorBoard, summed over ranks exactly, resumed by name). Validation is the base class's:
the student's cross-entropy and accuracy.
"""

import torch
import torch.nn.functional as F

from common import checkpoint, models
from common.cli import number_in
from common.trainer import Trainer


class Distillation(Trainer):
    @classmethod
    def add_arguments(cls, parser):
        parser.add_argument("--teacher", required=True, metavar="PATH", help="the teacher's checkpoint")
        parser.add_argument("--teacher-arch", default="resnet50", help="the teacher's --arch (%(default)s)")
        parser.add_argument(
            "--distill-alpha", type=number_in(0, 1), default=0.5, help="weight of the distillation term"
        )
        parser.add_argument(
            "--distill-temperature", type=number_in(0, 1000, low_open=True), default=4.0, help="softmax temperature T"
        )

    def build_model(self, classes):
        student = super().build_model(classes)
        teacher = models.build_model(self.config.teacher_arch, len(classes))
        saved = checkpoint.load_checkpoint(self.config.teacher)  # weights_only=True: nothing in it runs
        checkpoint.load_weights(teacher, saved, self.config.teacher_arch, classes, self.config.teacher)
        # Frozen, in eval mode, on this process's device; not part of the student, so not in its checkpoints.
        self.teacher = teacher.eval().requires_grad_(False).to(self.runtime.device)
        return student

    def train_step(self, model, images, labels):
        logits = model(images)
        with torch.no_grad():
            teacher_logits = self.teacher(images)
        temperature, alpha = self.config.distill_temperature, self.config.distill_alpha
        ce = self.criterion(logits, labels)
        distill = (
            F.kl_div(
                F.log_softmax(logits / temperature, dim=1),
                F.log_softmax(teacher_logits / temperature, dim=1),
                reduction="batchmean",
                log_target=True,
            )
            * temperature**2
        )
        return (1 - alpha) * ce + alpha * distill, logits, {"ce_loss": ce, "distill_loss": distill}
