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
from common.errors import UsageError
from common.trainer import Trainer


class Distillation(Trainer):
    @classmethod
    def add_arguments(cls, parser):
        parser.add_argument("--teacher", metavar="PATH", help="the teacher's checkpoint (to train; -e needs none)")
        parser.add_argument("--teacher-arch", default="resnet50", help="the teacher's --arch (%(default)s)")
        parser.add_argument(
            "--distill-alpha", type=number_in(0, 1), default=0.5, help="weight of the distillation term"
        )
        parser.add_argument(
            "--distill-temperature", type=number_in(0, 1000, low_open=True), default=4.0, help="softmax temperature T"
        )

    def build_model(self, classes):
        student, config, self.teacher = super().build_model(classes), self.config, None
        if config.evaluate:  # (-e evaluates the student alone)
            return student
        if config.teacher is None:
            raise UsageError("--teacher PATH: give the teacher's checkpoint file (train_fsdp.py's: its model_best.pth)")
        teacher = models.build_model(config.teacher_arch, len(classes))
        saved = checkpoint.weights_file(config.teacher, "--teacher")  # weights_only=True: nothing in it runs
        if saved.get("arch") not in (None, config.teacher_arch):
            raise UsageError(
                f"--teacher {config.teacher} holds a {saved['arch']} model: give --teacher-arch {saved['arch']}"
            )
        checkpoint.load_weights(teacher, saved, config.teacher_arch, classes, config.teacher)
        # Frozen, in eval mode, on this process's device; not part of the student, so not in its checkpoints.
        self.teacher = teacher.eval().requires_grad_(False).to(self.runtime.device)
        return student

    def train_step(self, model, images, labels):
        # (a student with auxiliary heads, GoogLeNet's: their losses added to the main one's, as without a teacher)
        ce, logits = models.loss_with_aux(
            self.criterion, model(images), labels, getattr(self.model, "aux_loss_weight", None)
        )
        with torch.no_grad():
            teacher_logits = models.split_output(self.teacher(images))[0]
        temperature, alpha = self.config.distill_temperature, self.config.distill_alpha
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
