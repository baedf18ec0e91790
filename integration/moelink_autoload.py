"""Entry point (group "torch.backends") that `import torch` runs in every process where
moelink is pip-installed, so that backend "ep" is registered even in processes that never
import moelink themselves (spawned workers, launchers). A broken install only warns here;
`import moelink` raises the full error. TORCH_DEVICE_BACKEND_AUTOLOAD=0 turns it off."""


def register() -> None:
    try:
        import moelink  # noqa: F401  (registers "ep")
    except Exception as e:  # noqa: BLE001
        import warnings

        warnings.warn(f"moelink: backend 'ep' not registered: {e}", RuntimeWarning, stacklevel=2)
