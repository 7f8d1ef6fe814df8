"""One agent: its model's train state, the jitted policy and SFT steps, the optimizer, the `Learner` that owns
them with the agent's sampler, pretrained imports and Hugging Face export. Knows nothing of the RL loop."""
