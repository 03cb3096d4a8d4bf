"""What the fleet does to loaded weights: sharding over the ranks, LoRA patches."""
