"""The config.json of the drafter a draftsmith run of CONFIGS trains (draftsmith.train.model.build_model_config on
the run's features), written to OUT for bench/peers/quality.py --base while that run is still training.

    PYTHONPATH=. python write_config.py OUT CONFIG [CONFIG ...]      # from the run's repository root
"""

import sys
from pathlib import Path

from safetensors import safe_open

sys.path.insert(0, "bench/peers")
from peerlib import load_config

from draftsmith.assets import resolve_target
from draftsmith.features import FeatureIndex
from draftsmith.target import weight_files
from draftsmith.train import TrainSettings
from draftsmith.train.model import build_model_config

out, files = Path(sys.argv[1]), sys.argv[2:]
config = load_config(files)
settings = TrainSettings.from_config(config)
target = resolve_target(config["target"]["model"], Path(config["assets"]["dir"]).resolve())
weights = weight_files(target)
key = next(k for k in weights if k.endswith("embed_tokens.weight"))
with safe_open(str(weights[key]), "pt") as f:
    vocab = f.get_slice(key).get_shape()[0]
cfg = build_model_config(FeatureIndex(Path("results/features/index.json")), target, settings.drafter, vocab)
(out / "config.json").write_text(cfg.to_json_string())
print(out / "config.json", vocab)
