"""Reward functions shipped with tidal, usable by import path in `reward_funcs[]` (TRL's interface)."""
