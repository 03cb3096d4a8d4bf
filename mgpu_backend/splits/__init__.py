"""The splits: how one forward or one stage is divided over the ranks (sequence parallel, guidance passes, tiles) and the plan that chooses."""
