"""Parallel strategies: one validated Strategy, batches of them as arrays, and the validity rules."""

from ndplan.strategy.batch import StrategyBatch
from ndplan.strategy.precision import PRECISION_PRESETS, PrecisionPolicy, get_precision
from ndplan.strategy.rules import (
    RULES,
    RuleContext,
    Violation,
    check_strategy,
    rule_masks,
    valid_mask,
    validate_strategy,
)
from ndplan.strategy.strategy import CP_KINDS, RECOMPUTES, SCHEDULES, Strategy

__all__ = [
    "CP_KINDS",
    "PRECISION_PRESETS",
    "RECOMPUTES",
    "RULES",
    "SCHEDULES",
    "PrecisionPolicy",
    "RuleContext",
    "Strategy",
    "StrategyBatch",
    "Violation",
    "check_strategy",
    "get_precision",
    "rule_masks",
    "valid_mask",
    "validate_strategy",
]
