"""An extra metric per epoch: `--trainer examples.extra_metric:WithConfidence`.

    python train_dp.py --trainer examples.extra_metric:WithConfidence

Return named values from train_step / evaluate_step: each is a batch mean, summed over ranks exactly (weighted
by the batch's images), shown on the progress and result lines, written to log.csv as train_NAME / val_NAME
(new columns) and to TensorBoard, and resumed by name after a stop. Here: the top-5 error and the mean
confidence (the softmax's top probability), whose gap to the accuracy shows over- or under-confidence.
"""

import torch

from common.metrics import correct_counts
from common.trainer import Trainer


def confidence_and_top5_error(logits, target):
    (top5_hits,) = correct_counts(logits, target, topk=(5,))
    return {
        "top5_error": 100.0 * (1 - top5_hits / target.size(0)),
        "confidence": torch.softmax(logits.float(), dim=1).amax(dim=1).mean(),
    }


class WithConfidence(Trainer):
    def train_step(self, model, images, labels):
        loss, logits = super().train_step(model, images, labels)
        values = confidence_and_top5_error(logits.detach(), labels.argmax(dim=1) if labels.ndim > 1 else labels)
        if labels.ndim > 1:  # soft labels (--mixup-alpha / --cutmix-alpha) have no single class: the confidence alone
            del values["top5_error"]
        return loss, logits, values

    def evaluate_step(self, model, images, target):
        loss, logits = super().evaluate_step(model, images, target)
        return loss, logits, confidence_and_top5_error(logits, target)
