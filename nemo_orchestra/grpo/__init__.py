"""GRPO: composite reward, grouped advantages, the clipped policy loss."""
