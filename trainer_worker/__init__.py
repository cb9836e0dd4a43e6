"""trainer_worker package."""
