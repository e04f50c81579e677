"""Structured output: grammars compiled with xgrammar, token acceptance and the per-step bitmask.

Owns grammar compilation, each constrained request's matcher and the bitmask rows of a step
(`manager.py`), and applying the bitmask to logits (`apply_bitmask`, the worker half). Imports
contracts and `speculative` (where drafts sit in a verify step's rows).
"""
