"""What both framework callbacks share: the watch options they start the recorder with, its live
alarms, and the rule that nothing they do raises into training."""

from __future__ import annotations

import os
import warnings
from typing import Any

from warninglight.tracer.config import RecorderConfig, with_options

_DEFAULTS = RecorderConfig()


class Recording:
    """The recorder a callback starts, and how the callback stays out of training's way."""

    framework = "framework"  # named in the warning a failure gives

    def __init__(self, path: str | os.PathLike[str], ids_key: str, stop_on_alarm: bool,
                 watch_options: dict[str, Any]) -> None:
        self.path, self.ids_key, self.stop_on_alarm = os.fspath(path), ids_key, stop_on_alarm
        self.watch_options = watch_options
        self.rec: Any = None
        self._alarmed = False

    def _options(self, **defaults: Any) -> dict[str, Any]:
        """The watch options, with `defaults` (the framework's start step, ...) for those neither
        the keywords nor a `config=RecorderConfig(...)` among them give, and an `on_alarm` that
        also marks the run for `stop_on_alarm`."""
        options = dict(self.watch_options)
        config = with_options(options.get("config"), {})
        for name, value in defaults.items():
            if not _gives(options, config, name):
                options[name] = value
        user_on_alarm = options.pop("on_alarm", config.on_alarm)
        if not (options.get("alarms", config.alarms) or user_on_alarm is not None
                or self.stop_on_alarm):
            return options

        def on_alarm(alarm: dict[str, Any]) -> None:
            self._alarmed = True
            if user_on_alarm is not None:
                user_on_alarm(alarm)

        return {**options, "on_alarm": on_alarm}

    @property
    def alarms(self) -> list[dict[str, Any]]:
        """Live alarms raised so far (with `alarms=[...]` among the watch options)."""
        return self.rec.alarms if self.rec is not None else []

    def _guard(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            self._give_up(exc)

    def _give_up(self, exc: Exception) -> None:
        warnings.warn(f"warninglight: {self.framework} callback failed ({type(exc).__name__}: "
                      f"{exc}); training continues", RuntimeWarning, stacklevel=3)


def _gives(options: dict[str, Any], config: RecorderConfig, name: str) -> bool:
    """Whether the user set `name`: as a keyword, or in the config (an option away from its
    default, or a key of its run config)."""
    if name in options:
        return True
    if hasattr(_DEFAULTS, name):
        return getattr(config, name) != getattr(_DEFAULTS, name)
    return name in config.run_config
