"""Reading and writing Hugging Face safetensors checkpoints one tensor at a time."""
