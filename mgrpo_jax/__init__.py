"""mgrpo_jax: M-GRPO (hierarchical multi-agent GRPO) on JAX/TPU."""

__version__ = "0.1.0"
