"""Per-class accuracy, balanced accuracy and a confusion matrix: `--trainer examples.confusion_matrix:PerClass`.

    torchrun --standalone --nproc-per-node 2 train_ddp.py --trainer examples.confusion_matrix:PerClass

A metric that is not a mean over images keeps a state (here the counts of true against predicted classes)
that the run sums on the device (no host sync per step) and over the ranks exactly, checkpoints mid-epoch and
resumes. Its numbers (balanced_acc) are shown and logged like the loss (train_balanced_acc, val_balanced_acc in
log.csv and TensorBoard), its tensors written to metrics/val_epochE.json; after_validation sees them summed.
"""

from common.metrics import ConfusionMatrix
from common.trainer import Trainer


class PerClass(Trainer):
    def build_metrics(self, split, classes):
        return {"confusion": ConfusionMatrix(len(classes))}

    def after_validation(self, epoch, results, label=""):
        present = results["confusion"].sum(dim=1) > 0  # classes with validation images
        worst = results["per_class_acc"].masked_fill(~present, float("inf")).argmin().item()
        self.log.print(
            f" * {label + ' ' if label else ''}per-class acc@1 "
            f"{', '.join(f'{acc:.1f}' for acc in results['per_class_acc'].tolist())}; "
            f"lowest: {self.classes[worst]}"
        )
