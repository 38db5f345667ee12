"""Schedulers for the noise multiplier and the clipping norm of a DPOptimizer."""

from .grad_clip_scheduler import (
    ExponentialGradClip,
    LambdaGradClip,
    StepGradClip,
    _GradClipScheduler,
)
from .noise_scheduler import ExponentialNoise, LambdaNoise, StepNoise, _NoiseScheduler

__all__ = [
    "_GradClipScheduler",
    "ExponentialGradClip",
    "LambdaGradClip",
    "StepGradClip",
    "_NoiseScheduler",
    "ExponentialNoise",
    "LambdaNoise",
    "StepNoise",
]
