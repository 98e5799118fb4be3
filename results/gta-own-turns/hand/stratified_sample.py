import random, sys
from pathlib import Path
import envs
from lab import ownturns
env = envs.GTAEnv("train", "../shared/data/pair-release", match="loose")
turns, _ = ownturns.load_turns(Path("results/gta-own-turns/train/parts"), env)
rng = random.Random(1)
right = [t for t in turns if t.verdict.label == 1]
wrong_mid = [t for t in turns if t.verdict.label == 0 and t.verdict.kind == "call"
             and envs.assistant_parts(env.records[t.episode_id]["dialogs"][t.turn_idx])[1] is not None]
final = [t for t in turns if t.verdict.kind == "final" and t.verdict.label is not None]
pick = rng.sample(right, 15) + rng.sample(wrong_mid, 25) + rng.sample(final, 10)
for t in pick:
    gold = envs.render_assistant(env.records[t.episode_id]["dialogs"][t.turn_idx])
    print(f"\n=== {t.episode_id} turn {t.turn_idx} sample {t.sample}{' (greedy)' if t.greedy else ''}: "
          f"{t.verdict.kind} {'right' if t.verdict.label else 'wrong'} ({t.verdict.reason})\n"
          f"--- own turn:\n{t.text}\n--- gold turn:\n{gold}")
