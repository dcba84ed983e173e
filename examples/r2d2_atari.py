"""R2D2 (Kapturowski et al., 2019) on Atari or MinAtar: recurrent replay with stored LSTM state,
burn-in, overlapping windows prioritized per window start, frames stacked inside each window.

- ``ActorGroup`` runs ``--actors`` processes, each on its own lane of the replay buffer, each
  stepping its environment epsilon-greedily (Ape-X's per-actor epsilon) with its own copy of
  the recurrent Q-network. Every step stores one frame (``next_obs="derived"``: no frame twice)
  and the LSTM state ``h``, ``c`` the actor held before that step.
- The learner reads windows of ``--burn-in`` + ``--train-len`` steps (40 + 80 = 120, as in the
  paper) starting every ``--stride`` steps of an episode (40: adjacent windows overlap by 40):
  ``Plan(sequence_length=120, stride=40, frame_stack=4, cross_episodes=True)``. Each step of a
  window arrives with its last 4 frames, zero-padded at the episode start. The learner unrolls
  the burn-in from the state stored at the window's first step (no gradient), then trains on
  the rest: n-step double-Q targets with R2D2's value rescaling, and ``[B, T]`` |TD errors|
  that the pool reduces to one priority per window start, ``eta * max + (1 - eta) * mean``.
  Actors enter each window start at the priority their own Q-values give it (writing rows
  ``stride`` at a time once the start's window is played: ``writer.extend(rows,
  priorities=ps)``).
- The learner publishes its weights every ``--publish-every`` updates into a
  ``shmbuf.WeightStore``; each actor copies a new version into its network when there is one.

``--env`` takes an ALE id (``ALE/Pong-v5``: gymnasium's ``AtariPreprocessing``, one 84x84
grey frame per step) or a MinAtar game (``MinAtar/SpaceInvaders``: 10x10 boolean channels, no
preprocessing). Run: ``python examples/r2d2_atari.py --seconds 60`` (needs torch, gymnasium
and ``minatar``, or ``ale-py`` and ``opencv-python-headless``: ``pip install -e '.[atari]'``).
``--device cuda`` trains on a GPU. It prints progress every few seconds and a ``result:`` line.
The paper's windows (40 + 80) suit Atari's long episodes; a MinAtar episode of a young policy
ends within 10-40 steps, inside the burn-in, leaving most windows nothing to train. For
MinAtar: ``--burn-in 4 --train-len 16 --stride 8 --batch-size 32`` (BENCHMARKS.md, "Ape-X on
MinAtar/ALE", has the learning runs).
"""

from __future__ import annotations

import argparse
import time
from collections import deque
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from apex_atari import EPISODE_SPEC, minatar_game, progress  # the Ape-X example, beside this one

import shmbuf
from shmbuf.sampling import Plan
from workers import ActorGroup, SamplerPool
from workers.config import Workers
from workers.selection import Prioritized

FIELDS = ["obs", "action", "reward", "terminated", "h", "c"]  # what the learner reads


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--env", default="MinAtar/SpaceInvaders",
                   help="an ALE id (ALE/Pong-v5) or a MinAtar game (MinAtar/Breakout)")
    p.add_argument("--seconds", type=float, default=20.0, help="train for this long at most")
    p.add_argument("--min-updates", type=int, default=0,
                   help="go on past --seconds until the learner made this many updates")
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-method", default="forkserver",
                   choices=["fork", "forkserver", "spawn"])
    p.add_argument("--device", default="cpu", help="the learner's torch device (cuda)")
    p.add_argument("--buffer-size", type=int, default=20_000, help="steps per actor lane")
    p.add_argument("--batch-size", type=int, default=16, help="windows per batch")
    p.add_argument("--burn-in", type=int, default=40)
    p.add_argument("--train-len", type=int, default=80)
    p.add_argument("--stride", type=int, default=40, help="steps between window starts")
    p.add_argument("--frame-stack", type=int, default=4)
    p.add_argument("--n-step", type=int, default=5)
    p.add_argument("--gamma", type=float, default=0.997)
    p.add_argument("--hidden", type=int, default=128, help="LSTM units (the paper: 512)")
    p.add_argument("--alpha", type=float, default=0.9, help="priority exponent")
    p.add_argument("--beta", type=float, default=0.6, help="importance-weight exponent")
    p.add_argument("--eta", type=float, default=0.9, help="max/mean mix of a window's priority")
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--learning-starts", type=int, default=2_000, help="steps before learning")
    p.add_argument("--target-every", type=int, default=500, help="updates between target syncs")
    p.add_argument("--publish-every", type=int, default=10, help="updates between publishes")
    return p.parse_args(argv)


# -- environments ------------------------------------------------------------------------------
def is_minatar(env_id: str) -> bool:
    return env_id.lower().startswith("minatar")


class MinAtarEnv:
    """A MinAtar game behind gymnasium's reset/step: boolean ``[10, 10, C]`` frames."""

    def __init__(self, env_id: str, seed: int) -> None:
        from minatar import Environment

        self.env = Environment(minatar_game(env_id))
        self.env.seed(seed)
        self.actions = list(self.env.minimal_action_set())  # as ALE's, and Ape-X's example
        self.n_actions = len(self.actions)
        self.frame_shape = tuple(self.env.state_shape())
        self.frame_dtype = np.dtype(np.bool_)

    def reset(self) -> np.ndarray:
        self.env.reset()
        return self.env.state()

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool]:
        reward, terminated = self.env.act(self.actions[action])
        return self.env.state(), float(reward), bool(terminated), False

    def close(self) -> None:
        pass


class AtariEnv:
    """An ALE game with gymnasium's ``AtariPreprocessing``: grey 84x84 ``uint8`` frames."""

    def __init__(self, env_id: str, seed: int) -> None:
        import ale_py
        import gymnasium as gym

        gym.register_envs(ale_py)
        env = gym.make(env_id, frameskip=1, repeat_action_probability=0.25)
        self.env = gym.wrappers.AtariPreprocessing(env, frame_skip=4, screen_size=84,
                                                   grayscale_obs=True, noop_max=30)
        self.seed = seed
        self.n_actions = int(self.env.action_space.n)
        self.frame_shape = (84, 84)
        self.frame_dtype = np.dtype(np.uint8)

    def reset(self) -> np.ndarray:
        obs, _ = self.env.reset(seed=self.seed)
        self.seed += 1_000_003  # the next episode differs
        return obs

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool]:
        obs, reward, terminated, truncated, _ = self.env.step(action)
        return obs, float(reward), bool(terminated), bool(truncated)

    def close(self) -> None:
        self.env.close()


def make_env(env_id: str, seed: int) -> MinAtarEnv | AtariEnv:
    return MinAtarEnv(env_id, seed) if is_minatar(env_id) else AtariEnv(env_id, seed)


# -- the network -------------------------------------------------------------------------------
class R2D2Net(nn.Module):
    """Conv torso over a stack of k frames, an LSTM, a dueling head: ``[B, T, k, *frame]`` ->
    Q ``[B, T, A]`` and the LSTM state after the last step."""

    def __init__(self, frame_shape: tuple[int, ...], frame_stack: int, n_actions: int,
                 hidden: int) -> None:
        super().__init__()
        self.minatar = len(frame_shape) == 3  # [10, 10, C] channels-last booleans
        channels = frame_stack * (frame_shape[2] if self.minatar else 1)
        if self.minatar:
            self.torso = nn.Sequential(nn.Conv2d(channels, 16, 3), nn.ReLU(), nn.Flatten())
            size = 16 * (frame_shape[0] - 2) * (frame_shape[1] - 2)
        else:
            self.torso = nn.Sequential(
                nn.Conv2d(channels, 32, 8, 4), nn.ReLU(), nn.Conv2d(32, 64, 4, 2), nn.ReLU(),
                nn.Conv2d(64, 64, 3, 1), nn.ReLU(), nn.Flatten())
            size = 64 * 7 * 7
        self.lstm = nn.LSTM(size, hidden, batch_first=True)
        self.value = nn.Linear(hidden, 1)
        self.advantage = nn.Linear(hidden, n_actions)

    def forward(self, obs: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        b, t, k = obs.shape[:3]
        x = obs.reshape(b * t, k, *obs.shape[3:]).float()
        if self.minatar:  # [N, k, H, W, C] -> [N, k * C, H, W]
            x = x.permute(0, 1, 4, 2, 3).reshape(b * t, -1, *obs.shape[3:5])
        else:
            x = x / 255.0
        features = self.torso(x).reshape(b, t, -1)
        h, c = state
        out, (h, c) = self.lstm(features, (h[None], c[None]))
        adv = self.advantage(out)
        q = self.value(out) + adv - adv.mean(-1, keepdim=True)
        return q, (h[0], c[0])


def rescale(x: torch.Tensor, eps: float = 1e-3) -> torch.Tensor:
    """R2D2's value rescaling h(x) = sign(x)(sqrt(|x| + 1) - 1) + eps x."""
    return torch.sign(x) * (torch.sqrt(x.abs() + 1.0) - 1.0) + eps * x


def unscale(x: torch.Tensor, eps: float = 1e-3) -> torch.Tensor:
    """h^-1(x)."""
    inner = (torch.sqrt(1.0 + 4.0 * eps * (x.abs() + 1.0 + eps)) - 1.0) / (2.0 * eps)
    return torch.sign(x) * (inner ** 2 - 1.0)


# -- actors ------------------------------------------------------------------------------------
class PendingWindows:
    """An actor's steps not written yet. A window start's priority needs the TD errors of its
    whole window, so rows are written ``stride`` at a time once the window of the first of
    them (and its n-step bootstraps) has been played, or when the episode ends: R2D2's actors
    likewise insert a sequence with its priority once it is complete.

    Priorities come from the actor's own Q-values (Ape-X: the local network is both online
    and target), reduced per window as the learner's are (``window_priority``)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.stride, self.burn = args.stride, args.burn_in
        self.length, self.n, self.gamma, self.eta = (args.burn_in + args.train_len, args.n_step,
                                                     args.gamma, args.eta)
        self.rows: dict[str, list[Any]] = {}
        self.q: list[np.ndarray] = []

    def __len__(self) -> int:
        return len(self.q)

    def add(self, q: np.ndarray, **row: Any) -> None:
        for name, value in row.items():
            self.rows.setdefault(name, []).append(value)
        self.q.append(q)

    def ready(self) -> bool:
        """The first pending step's window and its bootstraps are played."""
        return len(self.q) >= self.length + self.n

    def write(self, writer: Any, terminated: bool) -> None:
        """Write the first ``stride`` pending steps (a window start, then the steps up to the
        next one), the start with its window's priority.
        ``terminated``: the pending steps end the episode by termination (no bootstrap)."""
        count = min(self.stride, len(self.q))
        rows = {name: np.stack(values[:count]) for name, values in self.rows.items()}
        priorities = np.zeros(count)  # the rows after the start start no window of their own
        priorities[0] = self.window_priority(terminated)
        writer.extend(rows, priorities=priorities)
        for values in self.rows.values():
            del values[:count]
        del self.q[:count]

    def window_priority(self, episode_terminated: bool) -> float:
        """eta * max + (1 - eta) * mean |TD| over the trained steps of the window that starts
        at the first pending step (0 if none has a target)."""
        steps = min(len(self.q), self.length + self.n)
        q = torch.from_numpy(np.stack(self.q[:steps]))[None]  # [1, L, A]
        actions = torch.as_tensor(self.rows["action"][:steps])[None]
        rewards = torch.as_tensor(np.asarray(self.rows["reward"][:steps], np.float32))[None]
        done = torch.zeros(1, steps, dtype=torch.bool)
        if episode_terminated and steps == len(self.q):
            done[0, -1] = True
        targets, valid = nstep_targets(rewards, done, torch.ones(1, steps, dtype=torch.bool),
                                       q.max(2).values, self.n, self.gamma)
        td = (q.gather(2, actions[..., None]).squeeze(2) - targets).abs()
        kept = valid[0, self.burn:self.length]
        if not kept.any():
            return 0.0
        trained = td[0, self.burn:self.length][kept]
        return float(self.eta * trained.max() + (1 - self.eta) * trained.mean())


def make_actor(args: argparse.Namespace, store_name: str) -> Any:
    """The function ``ActorGroup`` runs in each actor process (plain values only)."""
    env_id, n_actors, k, hidden = args.env, args.actors, args.frame_stack, args.hidden

    def actor(ctx: Any) -> None:
        torch.set_num_threads(1)
        env = make_env(env_id, int(ctx.rng.integers(2**31)))
        net = R2D2Net(env.frame_shape, k, env.n_actions, hidden)
        store = shmbuf.WeightStore.attach(store_name)
        version = store.load_into(net, timeout=30.0)
        # Ape-X's per-actor epsilon: 0.4 ** (1 + 7 i / (N - 1))
        epsilon = 0.4 ** (1 + 7 * ctx.actor_id / max(n_actors - 1, 1))
        zero = np.zeros(env.frame_shape, env.frame_dtype)
        pending = PendingWindows(args)
        try:
            while not ctx.stopping:
                frame = env.reset()
                frames = deque([zero] * (k - 1) + [frame], maxlen=k)  # zero-padded, as stored
                h = c = torch.zeros(1, hidden)
                episode_return, length, done, terminated = 0.0, 0, False, False
                while not done and not ctx.stopping:
                    newer = store.load_into(net, if_newer_than=version)
                    version = newer if newer is not None else version
                    with torch.no_grad():
                        stacked = torch.from_numpy(np.stack(frames))[None, None]
                        q, (h_next, c_next) = net(stacked, (h, c))
                    if ctx.rng.random() < epsilon:
                        action = int(ctx.rng.integers(env.n_actions))
                    else:
                        action = int(q[0, 0].argmax())
                    next_frame, reward, terminated, truncated = env.step(action)
                    # h, c: the state held *before* this step (a window starting here
                    # unrolls from it)
                    pending.add(q[0, 0].numpy(), obs=frame, next_obs=next_frame, action=action,
                                reward=np.float32(reward), terminated=terminated,
                                h=h[0].numpy(), c=c[0].numpy())
                    if pending.ready():
                        pending.write(ctx.writer, terminated=False)
                    episode_return += reward
                    length += 1
                    frame, h, c = next_frame, h_next, c_next
                    frames.append(frame)
                    done = terminated or truncated
                if done:
                    while len(pending):
                        pending.write(ctx.writer, terminated=terminated)
                    ctx.writer.end_episode(truncated=not terminated, **{
                        "return": episode_return, "length": length,
                        "ended_ns": time.time_ns()})
        finally:
            env.close()
            store.close()

    return actor


# -- the learner -------------------------------------------------------------------------------
def nstep_targets(rewards: torch.Tensor, terminated: torch.Tensor, mask: torch.Tensor,
                  bootstrap: torch.Tensor, n: int, gamma: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets [B, L], valid [B, L]) for the trained steps: the n-step return, plus
    ``gamma^n h^-1(bootstrap[t + n])`` unless the episode terminated first. A step is valid if
    it is in the window's episode and either its episode terminates within n steps or step
    t + n is still in the window (truncations and window ends leave no bootstrap)."""
    b, length = rewards.shape
    index = torch.arange(length, device=rewards.device)[:, None] + torch.arange(
        n, device=rewards.device)[None, :]  # [L, n]
    pad = torch.nn.functional.pad
    r = pad(rewards, (0, n))[:, index]  # [B, L, n]
    d = pad(terminated.float(), (0, n))[:, index]
    m = pad(mask.float(), (0, n))[:, index]
    alive = torch.cumprod(torch.cat([torch.ones_like(d[..., :1]), 1.0 - d[..., :-1]], -1), -1)
    counted = alive * m  # steps whose reward belongs to the return
    discounts = gamma ** torch.arange(n, device=rewards.device, dtype=rewards.dtype)
    returns = (r * counted * discounts).sum(-1)
    ended = (d * counted).amax(-1) > 0  # terminated within the n steps
    later = torch.arange(length, device=rewards.device) + n
    has_next = (later < length)[None, :] & (pad(mask.float(), (0, n))[:, later] > 0)
    boot = pad(bootstrap, (0, n))[:, later]
    targets = returns + torch.where(ended, 0.0, gamma ** n * unscale(boot))
    return rescale(targets), mask & (ended | has_next)


def train(args: argparse.Namespace) -> dict[str, float]:
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # the cores are the actors'
    device = torch.device(args.device)
    probe = make_env(args.env, args.seed)
    frame_shape, frame_dtype, n_actions = probe.frame_shape, probe.frame_dtype, probe.n_actions
    probe.close()
    k, burn, length = args.frame_stack, args.burn_in, args.burn_in + args.train_len
    online = R2D2Net(frame_shape, k, n_actions, args.hidden).to(device)
    target = R2D2Net(frame_shape, k, n_actions, args.hidden).to(device)
    target.load_state_dict(online.state_dict())
    optimizer = torch.optim.Adam(online.parameters(), lr=args.learning_rate, eps=1e-3)
    spec = shmbuf.Spec(obs=(frame_shape, frame_dtype), action=((), "int64"),
                       reward=((), "float32"), terminated=((), "bool"),
                       h=((args.hidden,), "float32"), c=((args.hidden,), "float32"))
    plan = Plan(sequence_length=length, stride=args.stride, frame_stack=k, cross_episodes=True)
    selection = Prioritized(alpha=args.alpha, beta=args.beta, eta=args.eta)
    limit = shmbuf.RateLimit(min_size=max(args.learning_starts, length + 1))
    print(f"env {args.env}: frames {frame_shape} {frame_dtype}, {n_actions} actions; windows "
          f"of {burn} + {args.train_len} steps every {args.stride}, frame stack {k}; each "
          f"window start at its actor's priority", flush=True)
    with shmbuf.ReplayBuffer.create(spec, args.buffer_size, lanes=args.actors,
                                    next_obs="derived", episode_spec=EPISODE_SPEC,
                                    actor_priorities=True) as buf, \
            shmbuf.WeightStore.create(template=online.state_dict()) as store:
        store.publish(online)
        with ActorGroup(make_actor(args, store.name), args.actors, buf,
                        start_method=args.start_method, seed=args.seed) as actors, \
                SamplerPool(buf, args.batch_size, selection=selection, plan=plan, limit=limit,
                            fields=FIELDS, workers=Workers(1, start_method=args.start_method),
                            output="torch", seed=args.seed, timeout=60) as pool:
            t0 = next_report = time.monotonic()
            updates, trained, loss_value = 0, 0, float("nan")
            while time.monotonic() - t0 < args.seconds or updates < args.min_updates:
                try:
                    batch = pool.next(timeout=1.0)
                except shmbuf.errors.Timeout:  # no window yet (min_size): keep to --seconds
                    actors.poll()
                    continue
                obs = batch["obs"].to(device)
                mask = batch["mask"].to(device)
                state = (batch["h"][:, 0].to(device), batch["c"][:, 0].to(device))
                with torch.no_grad():  # burn-in: from the stored state, no gradient
                    _, online_state = online(obs[:, :burn], state)
                    _, target_state = target(obs[:, :burn], state)
                    q_target, _ = target(obs[:, burn:], target_state)
                q, _ = online(obs[:, burn:], online_state)
                actions = batch["action"][:, burn:].to(device)
                taken = q.gather(2, actions[..., None]).squeeze(2)
                with torch.no_grad():
                    best = q.argmax(2, keepdim=True)  # double Q: online picks, target values
                    y, valid = nstep_targets(
                        batch["reward"][:, burn:].to(device),
                        batch["terminated"][:, burn:].to(device), mask[:, burn:],
                        q_target.gather(2, best).squeeze(2), args.n_step, args.gamma)
                td = (taken - y) * valid
                # importance weights scaled by the batch's largest, as Acme's R2D2: the
                # buffer-wide normalisation (P_i / P_min)^-beta lets the windows that train no
                # step (priority 0, short episodes) shrink every other window's weight, and the
                # loss with it, by 100-1000x (Adam's eps of 1e-3 then all but stops learning)
                weights = torch.as_tensor(batch.weights).to(device)[:, None]
                weights = weights / weights.max()
                loss = (weights * td.pow(2)).sum() / valid.sum().clamp(min=1)
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(online.parameters(), 40.0)
                optimizer.step()
                # one priority per window start: the pool reduces [B, T] |TD| over the trained
                # steps (eta * max + (1 - eta) * mean); a window with none keeps priority 0
                steps = torch.zeros(mask.shape, dtype=torch.bool)
                steps[:, burn:] = valid.cpu()
                priorities = torch.zeros(mask.shape)
                priorities[:, burn:] = td.detach().abs().cpu()
                steps[~steps.any(1), 0] = True
                pool.update_priorities(batch.indices, priorities.numpy(), mask=steps.numpy())
                updates += 1
                trained += int(valid.sum())
                if updates % args.target_every == 0:
                    target.load_state_dict(online.state_dict())
                if updates % args.publish_every == 0:
                    store.publish(online)
                if time.monotonic() >= next_report:
                    actors.poll()  # re-raises an actor's exception, restarts a crashed one
                    loss_value = loss.item()
                    steps, episodes, ret = progress(buf)
                    print(f"{time.monotonic() - t0:5.1f}s  env steps {steps:7d}  updates "
                          f"{updates:5d}  trained steps {trained:7d}  episodes {episodes:4d}  "
                          f"recent return {ret:6.2f}  loss {loss_value:.4f}", flush=True)
                    next_report = time.monotonic() + 2.0
            steps, episodes, ret = progress(buf)
            result = {"seconds": time.monotonic() - t0, "env_steps": steps,
                      "updates": updates, "trained_steps": trained, "episodes": episodes,
                      "return": ret, "version": store.version,
                      "actor_priorities": pool.stats().get("actor_priorities_entered", 0)}
    print(f"result: recent return {result['return']:.2f} after {result['env_steps']} env steps, "
          f"{result['updates']} updates ({result['trained_steps']} trained steps), "
          f"{result['episodes']} episodes, weights version {result['version']}, "
          f"{result['actor_priorities']} window starts at their actor's priority in "
          f"{result['seconds']:.1f} s", flush=True)
    return result


if __name__ == "__main__":
    train(parse_args())
