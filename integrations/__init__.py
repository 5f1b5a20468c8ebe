"""One-line callbacks for training frameworks: Hugging Face Trainer and Lightning."""
