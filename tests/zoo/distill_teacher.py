"""Knowledge distillation from a dropout teacher that the user set to eval mode.

Origin: github.com/pytorch/tutorials, beginner_source/knowledge_distillation_tutorial.py: DeepNN
(the teacher: convolutions, flatten, a classifier with Dropout(0.1)), LightNN (the student), and
train_knowledge_distillation (teacher.eval(), student.train(), the teacher's logits without
gradients, soft targets at temperature T, loss = 0.25 * soft-target loss + 0.75 * cross entropy,
Adam(student, lr=0.001)). The two networks in one module for fit; its teacher is set to eval mode
by the user before training, as the tutorial does.
"""

import torch
import torch.nn as nn
import torch.optim as optim

from zoo import Case

T, soft_target_loss_weight, ce_loss_weight = 2, 0.25, 0.75


class DeepNN(nn.Module):
    def __init__(self, num_classes=10):
        super(DeepNN, self).__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 128, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(128, 64, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
            nn.Conv2d(64, 64, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(64, 32, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        self.classifier = nn.Sequential(
            nn.Linear(2048, 512),
            nn.ReLU(),
            nn.Dropout(0.1),
            nn.Linear(512, num_classes)
        )

    def forward(self, x):
        x = self.features(x)
        x = torch.flatten(x, 1)
        x = self.classifier(x)
        return x


class LightNN(nn.Module):
    def __init__(self, num_classes=10):
        super(LightNN, self).__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
            nn.Conv2d(16, 16, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        self.classifier = nn.Sequential(
            nn.Linear(1024, 256),
            nn.ReLU(),
            nn.Dropout(0.1),
            nn.Linear(256, num_classes)
        )

    def forward(self, x):
        x = self.features(x)
        x = torch.flatten(x, 1)
        x = self.classifier(x)
        return x


class Distiller(nn.Module):
    def __init__(self):
        super().__init__()
        self.teacher = DeepNN(num_classes=10)
        self.student = LightNN(num_classes=10)
        self.teacher.eval()  # the user's choice: the teacher's dropout is off

    def forward(self, x):
        return self.student(x)


def batches():
    g = torch.Generator().manual_seed(8)
    return [(torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(3)]


ce_loss = nn.CrossEntropyLoss()


def kd_loss(teacher, student, inputs, labels):
    with torch.no_grad():
        teacher_logits = teacher(inputs)
    student_logits = student(inputs)
    soft_targets = nn.functional.softmax(teacher_logits / T, dim=-1)
    soft_prob = nn.functional.log_softmax(student_logits / T, dim=-1)
    soft_targets_loss = torch.sum(soft_targets * (soft_targets.log() - soft_prob)) / soft_prob.size()[0] * (T**2)
    label_loss = ce_loss(student_logits, labels)
    return soft_target_loss_weight * soft_targets_loss + ce_loss_weight * label_loss


def hand(model, train_loader, amp):
    teacher, student = model.teacher, model.student
    optimizer = optim.Adam(student.parameters(), lr=0.001)
    teacher.eval()
    student.train()
    for inputs, labels in train_loader:
        optimizer.zero_grad()
        with amp():
            loss = kd_loss(teacher, student, inputs, labels)
        loss.backward()
        optimizer.step()


CASE = Case("distillation, dropout teacher in eval mode", Distiller, batches, hand,
            lambda model: {"compute_loss": lambda m, b: kd_loss(m.teacher, m.student, *b),
                           "optimizer": optim.Adam(model.student.parameters(), lr=0.001)})
