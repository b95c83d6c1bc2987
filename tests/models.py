"""Models for the CLI's ``module:function`` form."""

import torch


def tiny_mlp_with_inputs():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    return model, (torch.randn(4, 32),)
