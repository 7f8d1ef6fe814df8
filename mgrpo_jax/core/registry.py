"""Functions registered by name (the losses, the advantage estimators), so a config can pick them and a notebook
can add one."""

from collections.abc import Callable


class Registry:
    """`kind` names what is registered in errors ("loss"); `listing` introduces the known names ("registered
    losses")."""

    def __init__(self, kind: str, listing: str = "registered"):
        self.kind, self.listing = kind, listing
        self._fns: dict[str, Callable] = {}

    def register(self, name: str, *, overwrite: bool = False):
        """Decorator registering a function under `name`; a different function under a taken name needs
        `overwrite=True`."""

        def decorator(fn: Callable) -> Callable:
            if name in self._fns and not overwrite and self._fns[name] is not fn:
                article = "an" if self.kind[0] in "aeiou" else "a"
                raise ValueError(f"{article} {self.kind} named {name!r} is already registered; pass overwrite=True "
                                 "to replace it")
            self._fns[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> Callable:
        try:
            return self._fns[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; {self.listing}: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        return sorted(self._fns)
