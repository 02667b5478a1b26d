"""The memory planner: per-rank memory and communication of training a model under fully_shard, before any GPU.

``plan()`` (``api.py``) builds the model on the meta device and runs one training step of fully_shard itself on it
(``run.py``); ``Plan`` (``report.py``) holds the result and prints as a table; ``cli.py`` is ``python -m
fully_shard.plan``; ``models.py`` names models (Llama 3 presets, Hugging Face ``config.json``), ``activations.py``
estimates a Llama-family model's activations and ``plot.py`` draws memory over the step. ``fit()`` (``fit.py``)
searches the configurations for the fastest whose planned peak fits a budget (step-time model: ``cost.py``).
See docs/tools.md.

Example::

    >>> from fully_shard.tools.planner import plan
    >>> plan("llama3-8b", 64).peak_at  # when rank 0 of 64 holds the most
    'backward: reduce-scatter of LlamaForCausalLM (root)'
"""

from .api import plan
from .cost import PROFILES, DeviceProfile, measure_profile
from .fit import Recipe, Setting, fit
from .models import PRESETS, hf_model, load_model
from .plot import memory_figure, save_memory_plot
from .report import GroupPlan, Plan

plan.fit = fit  # type: ignore[attr-defined]  # fully_shard.plan.fit(...): the search beside the planner

__all__ = ["plan", "fit", "Recipe", "Setting", "DeviceProfile", "PROFILES", "measure_profile", "Plan", "GroupPlan",
           "PRESETS", "hf_model", "load_model", "memory_figure", "save_memory_plot"]
