"""Credit assignments registered by name, so a config can pick how one step's judged rollout becomes both roles'
rewards and advantages (issue 29: {distinct, shared} models x {M-GRPO, MATPO} credit).

A credit assignment maps the rollout's padded arrays to one step's targets:

    fn(arrays: RolloutArrays, key, config) -> Targets      # pure, jittable, `config` static (hashable)

and is registered with the config type it takes, so a caller holding only a name can build that config from a run
config (`credit_config_type(name).from_config(run_config)`). Each is registered under its algorithm's name; the
function that computes it is named `<name>_targets`. Shipped:

  mgrpo   M-GRPO's hierarchical targets (`mgrpo_targets`): main rows z-scored over K, sub rows over the aligned
          K * D pool (`TargetsConfig`, mgrpo_jax/core/mgrpo.py);
  matpo   MATPO's (`matpo_targets`): planner rewards over K only, each worker call gets its parent's advantage,
          per raw call [Q, K, C] with no alignment (`MatpoConfig`, mgrpo_jax/core/matpo.py).

A new one:

    @register_credit("my_credit", config_type=MyConfig)
    def my_credit(arrays, key, config): ...
"""

from collections.abc import Callable

from mgrpo_jax.core.matpo import MatpoConfig, matpo_targets
from mgrpo_jax.core.mgrpo import TargetsConfig, mgrpo_targets
from mgrpo_jax.core.registry import Registry

CreditFn = Callable[..., object]
_CREDITS = Registry("credit assignment", "registered credit assignments")
_CONFIG_TYPES: dict[str, type] = {}


def register_credit(name: str, *, config_type: type | None = None, overwrite: bool = False):
    """Decorator registering `fn(arrays, key, config) -> Targets` under `name`, with the (hashable) config type it
    takes; that type's `from_config(run_config)` builds it, where it has one."""
    register = _CREDITS.register(name, overwrite=overwrite)

    def decorator(fn):
        register(fn)
        _CONFIG_TYPES[name] = config_type
        return fn

    return decorator


def get_credit(name: str) -> CreditFn:
    """The credit assignment registered as `name`; an unknown name is a KeyError listing the registered ones."""
    return _CREDITS.get(name)


def credit_config_type(name: str) -> type | None:
    """The config type credit assignment `name` takes (None where it was registered without one)."""
    _CREDITS.get(name)  # an unknown name is a KeyError listing the registered ones
    return _CONFIG_TYPES.get(name)


def available_credits() -> list[str]:
    return _CREDITS.names()


register_credit("mgrpo", config_type=TargetsConfig)(mgrpo_targets)
register_credit("matpo", config_type=MatpoConfig)(matpo_targets)
