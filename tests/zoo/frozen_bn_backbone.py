"""A frozen backbone with BatchNorm kept in eval mode, a new head trained on it.

Origin: github.com/pytorch/vision, torchvision/models/resnet.py (BasicBlock: conv3x3, BatchNorm2d,
ReLU, a downsample shortcut); the "ConvNet as fixed feature extractor" recipe of
github.com/pytorch/tutorials beginner_source/transfer_learning_tutorial.py (requires_grad = False on
the backbone, a new final layer, SGD(lr=0.001, momentum=0.9) over its parameters); the backbone's
BatchNorm kept in eval mode as detection codebases do for a frozen backbone (mmdetection's ResNet
`norm_eval=True`). Widths made tiny.
"""

import torch
import torch.nn as nn
import torch.optim as optim

from zoo import Case


def conv3x3(in_planes, out_planes, stride=1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class FineTune(nn.Module):
    def __init__(self):
        super().__init__()
        down = nn.Sequential(nn.Conv2d(8, 16, 1, stride=2, bias=False), nn.BatchNorm2d(16))
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                                      BasicBlock(8, 8), BasicBlock(8, 16, stride=2, downsample=down),
                                      nn.AdaptiveAvgPool2d((1, 1)))
        for param in self.backbone.parameters():
            param.requires_grad = False
        self.backbone.eval()  # frozen BatchNorm: its running statistics stay as loaded
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        x = self.backbone(x)
        x = torch.flatten(x, 1)
        return self.fc(x)


def make():
    model = FineTune()
    with torch.no_grad():  # as if loaded: statistics that a train-mode BatchNorm would move
        for m in model.backbone.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return model


def batches():
    g = torch.Generator().manual_seed(9)
    return [(torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 5, (4,), generator=g)) for _ in range(3)]


def hand(model, dataloader, amp):
    criterion = nn.CrossEntropyLoss()
    optimizer_conv = optim.SGD(model.fc.parameters(), lr=0.001, momentum=0.9)
    for inputs, labels in dataloader:
        optimizer_conv.zero_grad()
        with amp():
            outputs = model(inputs)
            loss = criterion(outputs, labels)
        loss.backward()
        optimizer_conv.step()


CASE = Case("frozen eval-mode BatchNorm backbone", make, batches, hand,
            lambda model: {"loss_fn": nn.CrossEntropyLoss(),
                           "optimizer": optim.SGD(model.fc.parameters(), lr=0.001, momentum=0.9)})
