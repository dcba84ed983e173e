"""Ape-X DQN on MinAtar or ALE: actor processes with their own epsilons and actor-side
priorities, a prioritized n-step replay that stores each frame once, and a torch learner that
publishes its weights to the actors through a ``shmbuf.WeightStore``.

- ``ActorGroup`` runs ``--actors`` processes, each on its own lane. Actor i acts
  epsilon-greedily with Ape-X's ``eps_i = 0.4 ** (1 + 7 i / (N - 1))`` using its copy of the
  learner's network, which it refreshes every ``--sync-every`` steps with
  ``WeightStore.load_into(net, if_newer_than=v)`` (one shared load when nothing changed).
- Each step stores ONE frame (``obs``: 84x84 for ALE, the 10x10 boolean channels for MinAtar),
  in a buffer made with ``next_obs="derived"``; the learner's batches are rebuilt as stacks of
  ``--frame-stack`` frames with ``--n-step`` returns by ``Plan(frame_stack=4, n_step=3)``.
- Actors compute each transition's initial priority from the Q-values they computed anyway
  when acting (``|G_t + gamma^m max_a Q(s_t+m) - Q(s_t, a_t)|``) and write rows in chunks
  of ``--flush-rows`` (Ape-X's local buffer) with those priorities.
- The learner (double DQN, CPU or ``--device cuda``) pulls batches from a ``SamplerPool`` with
  ``Prioritized(alpha=0.6, beta=0.4)``, sets the batch's priorities to its |TD errors| and
  publishes its weights every ``--publish-every`` updates. Each row records the weights version
  its actor acted with, so the learner prints how far behind the actors' weights are.

While it runs, ``shmbuf top`` shows the buffer, the pool's staging ring and the weight store.

Run: ``python examples/apex_atari.py --env MinAtar/Breakout --seconds 60`` or
``--env ALE/Pong-v5`` (``pip install -e '.[atari]'``). ``--random-episodes 1000`` measures a
uniformly random policy's mean return instead, and exits. It prints one line per
``--report-every`` seconds and a final ``result:`` line.
"""

from __future__ import annotations

import argparse
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import shmbuf
from shmbuf.errors import RateLimitTimeout
from shmbuf.sampling import Plan
from workers import ActorGroup, SamplerPool
from workers.config import Workers
from workers.selection import Prioritized

MINATAR_PREFIX = "MinAtar/"
EPISODE_SPEC = {"return": ((), "float32"), "length": ((), "int32"), "ended_ns": ((), "int64")}
RETURN_WINDOW = 100  # episodes in the reported mean return


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--env", default="MinAtar/Breakout",
                   help="MinAtar/<Game> (breakout, asterix, freeway, seaquest, space_invaders) "
                        "or any ALE id, e.g. ALE/Pong-v5")
    p.add_argument("--seconds", type=float, default=60.0, help="run for this long")
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-method", default="forkserver",
                   choices=["fork", "forkserver", "spawn"])
    p.add_argument("--capacity", type=int, default=200_000, help="rows in all (split by lane)")
    p.add_argument("--frame-stack", type=int, default=4)
    p.add_argument("--n-step", type=int, default=3)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--alpha", type=float, default=0.6)
    p.add_argument("--beta", type=float, default=0.4)
    p.add_argument("--batch-size", type=int, default=128, help="Ape-X's is 512")
    p.add_argument("--learning-rate", type=float, default=2.5e-4)
    p.add_argument("--learning-starts", type=int, default=2_000, help="rows before learning")
    p.add_argument("--samples-per-insert", type=float, default=8.0,
                   help="rows sampled per row inserted (one side waits beyond it); 0: no ratio")
    p.add_argument("--target-every", type=int, default=500, help="updates between target syncs")
    p.add_argument("--publish-every", type=int, default=10,
                   help="updates between weight publications (K)")
    p.add_argument("--sync-every", type=int, default=100,
                   help="an actor looks for newer weights every this many steps (Ape-X: 100)")
    p.add_argument("--flush-rows", type=int, default=32,
                   help="an actor writes its rows in chunks of this many (Ape-X: 50)")
    p.add_argument("--max-episode-steps", type=int, default=10_000,
                   help="MinAtar episodes are truncated here (ALE ids have their own limit)")
    p.add_argument("--workers", type=int, default=1, help="sampler processes (0: in-process)")
    p.add_argument("--device", default="cpu", help="the learner's torch device: cpu or cuda")
    p.add_argument("--learner-threads", type=int, default=1, help="torch threads of the learner")
    p.add_argument("--report-every", type=float, default=5.0, help="seconds between lines")
    p.add_argument("--until-version", type=int, default=0,
                   help="also stop once the learner drew rows made with weights of this "
                        "version or newer (0: run --seconds)")
    p.add_argument("--random-episodes", type=int, default=0,
                   help="measure a uniformly random policy over this many episodes and exit")
    args = p.parse_args(argv)
    for name in ("actors", "capacity", "frame_stack", "n_step", "batch_size", "learning_starts",
                 "target_every", "publish_every", "sync_every", "flush_rows", "max_episode_steps",
                 "learner_threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.capacity // args.actors < 2 * args.flush_rows + args.n_step + args.frame_stack:
        p.error(f"--capacity {args.capacity} leaves too few rows per actor lane: give at least "
                f"{args.actors * (2 * args.flush_rows + args.n_step + args.frame_stack)}")
    return args


# --------------------------------------------------------------------------------------------
# Environments: one frame per step, channels first, uint8
# --------------------------------------------------------------------------------------------
def minatar_game(env_id: str) -> str:
    """MinAtar's name of a game: ``MinAtar/SpaceInvaders`` (or ``-v1``) -> ``space_invaders``."""
    game = env_id.split("/", 1)[-1].split("-v")[0]
    return "".join("_" + ch.lower() if ch.isupper() and i else ch.lower()
                   for i, ch in enumerate(game))


class MinAtarEnv:
    """A MinAtar game: frames are its boolean channels as uint8 ``[C, 10, 10]``, actions its
    minimal action set; episodes are truncated at ``max_episode_steps``. No preprocessing."""

    def __init__(self, env_id: str, seed: int, max_episode_steps: int) -> None:
        from minatar import Environment  # type: ignore[import-untyped]

        self.env = Environment(minatar_game(env_id))
        self.env.seed(seed)
        self.actions = list(self.env.minimal_action_set())
        h, w, c = self.env.state_shape()
        self.frame_shape: tuple[int, ...] = (c, h, w)
        self.n_actions = len(self.actions)
        self.scale = 1.0
        self.max_episode_steps = max_episode_steps
        self._t = 0

    def _frame(self) -> np.ndarray:
        return np.ascontiguousarray(self.env.state().transpose(2, 0, 1), dtype=np.uint8)

    def reset(self) -> np.ndarray:
        self.env.reset()
        self._t = 0
        return self._frame()

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool]:
        reward, terminated = self.env.act(self.actions[action])
        self._t += 1
        return (self._frame(), float(reward), bool(terminated),
                self._t >= self.max_episode_steps and not terminated)

    def close(self) -> None:
        pass


class AleEnv:
    """An ALE game through gymnasium's ``AtariPreprocessing`` (30 no-op starts, 4 frames per
    step max-pooled, 84x84 grayscale): frames ``[84, 84]`` uint8; rewards clipped to [-1, 1]
    for learning (``step`` returns the raw reward, ``clip`` clips)."""

    def __init__(self, env_id: str, seed: int) -> None:
        import ale_py
        import gymnasium as gym

        gym.register_envs(ale_py)
        env = gym.make(env_id, frameskip=1)  # AtariPreprocessing skips the frames itself
        self.env = gym.wrappers.AtariPreprocessing(env, noop_max=30, frame_skip=4,
                                                   screen_size=84, grayscale_obs=True)
        self._seed: int | None = seed
        self.frame_shape = (84, 84)
        space = self.env.action_space
        assert isinstance(space, gym.spaces.Discrete)  # every ALE game's
        self.n_actions = int(space.n)
        self.scale = 1.0 / 255.0

    def reset(self) -> np.ndarray:
        obs, _ = self.env.reset(seed=self._seed)
        self._seed = None  # seeded once; later episodes follow from it
        return np.asarray(obs, np.uint8)

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool]:
        obs, reward, terminated, truncated, _ = self.env.step(action)
        return np.asarray(obs, np.uint8), float(reward), bool(terminated), bool(truncated)

    def close(self) -> None:
        self.env.close()


def make_env(env_id: str, seed: int, max_episode_steps: int = 10_000) -> MinAtarEnv | AleEnv:
    if env_id.startswith(MINATAR_PREFIX):
        return MinAtarEnv(env_id, seed, max_episode_steps)
    return AleEnv(env_id, seed)


def clip_reward(env_id: str, reward: float) -> float:
    """Ape-X clips ALE rewards to [-1, 1]; MinAtar's are 0 or 1 already."""
    return reward if env_id.startswith(MINATAR_PREFIX) else float(np.clip(reward, -1.0, 1.0))


# --------------------------------------------------------------------------------------------
# The network: MinAtar's small conv net, or the Nature DQN for 84x84 frames
# --------------------------------------------------------------------------------------------
class QNetwork(nn.Module):
    """Q-values from a ``[B, k, *frame]`` uint8 stack (k frames, each ``[C, H, W]`` or
    ``[H, W]``), scaled by ``scale``."""

    def __init__(self, frame_shape: tuple[int, ...], frame_stack: int, n_actions: int,
                 scale: float) -> None:
        super().__init__()
        channels = frame_stack * (frame_shape[0] if len(frame_shape) == 3 else 1)
        h, w = frame_shape[-2:]
        self.scale = scale
        if (h, w) == (84, 84):
            self.body: nn.Module = nn.Sequential(
                nn.Conv2d(channels, 32, 8, 4), nn.ReLU(), nn.Conv2d(32, 64, 4, 2), nn.ReLU(),
                nn.Conv2d(64, 64, 3, 1), nn.ReLU(), nn.Flatten(), nn.Linear(3136, 512), nn.ReLU())
            width = 512
        else:
            self.body = nn.Sequential(nn.Conv2d(channels, 16, 3, 1), nn.ReLU(), nn.Flatten(),
                                      nn.Linear(16 * (h - 2) * (w - 2), 128), nn.ReLU())
            width = 128
        self.head = nn.Linear(width, n_actions)

    def forward(self, stack: torch.Tensor) -> torch.Tensor:
        x = stack.reshape(stack.shape[0], -1, *stack.shape[-2:]).float() * self.scale
        return self.head(self.body(x))


def apex_epsilon(actor_id: int, n_actors: int) -> float:
    """Ape-X's per-actor epsilon: 0.4 for actor 0 down to 0.4 ** 8 for the last."""
    return 0.4 ** (1 + 7 * actor_id / (n_actors - 1)) if n_actors > 1 else 0.4


# --------------------------------------------------------------------------------------------
# Actor-side priorities
# --------------------------------------------------------------------------------------------
def n_step_priorities(rewards: np.ndarray, q_taken: np.ndarray, q_best: np.ndarray, count: int,
                      n: int, gamma: float, ended: bool) -> np.ndarray:
    """|G_t + gamma^m max_a Q(s_t+m) - Q(s_t, a_t)| for steps 0 .. count-1 of ``rewards``.

    ``q_best[j]`` is max_a Q(s_j): known for every step acted on and, once the episode
    ``ended``, one past its last step (0 after a termination, the final observation's value
    after a truncation). m = n, or the steps left before the episode's end: the target the
    learner's n-step plan forms (its ``reward``, ``discount`` and ``next_obs``).
    """
    i = np.arange(count)
    m = np.minimum(n, len(rewards) - i) if ended else np.full(count, n)
    padded = np.concatenate([rewards, np.zeros(n, np.float64)])  # zeros past the episode's end
    returns = sum(gamma ** k * padded[k:k + count] for k in range(n))
    return np.abs(returns + gamma ** m * q_best[i + m] - q_taken[:count])


class Unwritten:
    """One actor's steps of the current episode that are not written yet, with what their
    priorities need: step t can be written once the actor has acted n steps past it (its
    bootstrap value is known), or its episode has ended.

    ``frames[j]`` is step j's newest frame and ``frames[len(rewards)]`` the frame after the last
    step (the next_obs of the last row, and the episode's final observation at its end).
    """

    def __init__(self, n_step: int, gamma: float) -> None:
        self.n_step, self.gamma = n_step, gamma
        self.frames: list[np.ndarray] = []
        self.actions: list[int] = []
        self.rewards: list[float] = []
        self.terminated: list[bool] = []
        self.q_taken: list[float] = []
        self.q_best: list[float] = []

    def begin(self, frame: np.ndarray) -> None:
        self.frames, self.actions, self.rewards, self.terminated = [frame], [], [], []
        self.q_taken, self.q_best = [], []

    def acted(self, q: np.ndarray, action: int) -> None:
        self.q_taken.append(float(q[action]))
        self.q_best.append(float(q.max()))
        self.actions.append(action)

    def stepped(self, frame: np.ndarray, reward: float, terminated: bool) -> None:
        self.frames.append(frame)
        self.rewards.append(reward)
        self.terminated.append(terminated)

    def ready(self) -> int:
        """Rows whose priority is known without the episode's end."""
        return max(0, len(self.q_best) - self.n_step)

    def take(self, version: int, final_value: float | None = None
             ) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The rows that can be written (all of them with ``final_value``, the episode's end:
        max_a Q of the final observation, 0 after a termination) and their priorities; they
        are dropped from here."""
        ended = final_value is not None
        count = len(self.rewards) if ended else self.ready()
        q_best = np.asarray(self.q_best + ([final_value] if ended else []), np.float64)
        priorities = n_step_priorities(np.asarray(self.rewards, np.float64),
                                       np.asarray(self.q_taken, np.float64), q_best, count,
                                       self.n_step, self.gamma, ended)
        rows = {"obs": np.stack(self.frames[:count]),
                "next_obs": np.stack(self.frames[1:count + 1]),
                "action": np.asarray(self.actions[:count], np.uint8),
                "reward": np.asarray(self.rewards[:count], np.float32),
                "terminated": np.asarray(self.terminated[:count], bool),
                "version": np.full(count, version, np.int32)}
        for name in ("frames", "actions", "rewards", "terminated", "q_taken", "q_best"):
            del getattr(self, name)[:count]
        return rows, priorities.astype(np.float32)


@dataclass(frozen=True)
class ActorConfig:
    """What every actor process needs (plain values: it travels to them pickled)."""

    env_id: str
    n_actors: int
    weights: str  # the WeightStore's name
    frame_stack: int
    n_step: int
    gamma: float
    flush_rows: int
    max_episode_steps: int
    sync_every: int = 100  # steps between looks at the weight store (Ape-X: 400 frames)


class ApexActor:
    """An Ape-X actor's loop: act epsilon-greedily on a stack of the last frames, compute the
    priorities, ``write(rows, priorities)`` chunks, ``end_episode(...)`` at each episode's end,
    and refresh the network from ``weights`` every ``sync_every`` steps (one load when
    unchanged).
    With ``write``, ``end_episode`` and ``weights`` None it does all the same work but the
    writing and the refreshing (``scripts/bench_apex.py`` times both ways).
    """

    def __init__(self, cfg: ActorConfig, actor_id: int, rng: np.random.Generator,
                 write: Callable[[dict[str, np.ndarray], np.ndarray], Any] | None,
                 end_episode: Callable[..., Any] | None,
                 weights: shmbuf.WeightStore | None, net: QNetwork | None = None) -> None:
        self.cfg, self.rng = cfg, rng
        self.env = make_env(cfg.env_id, int(rng.integers(2**31)), cfg.max_episode_steps)
        self.net = net or QNetwork(self.env.frame_shape, cfg.frame_stack, self.env.n_actions,
                                   self.env.scale)
        self.epsilon = apex_epsilon(actor_id, cfg.n_actors)
        self.write, self.end_episode, self.weights = write, end_episode, weights
        self.version = 0
        if weights is not None:  # the learner published before it started us
            self.version = weights.load_into(self.net, timeout=60.0) or 0
        self.steps = self.episodes = 0
        self.written_priorities = 0.0  # sum of the priorities computed (a cheap check)

    def _q(self, stack: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return self.net(torch.from_numpy(stack)[None])[0].numpy()

    def run(self, stopping: Callable[[], bool], max_steps: int | None = None) -> None:
        cfg, env = self.cfg, self.env
        unwritten = Unwritten(cfg.n_step, cfg.gamma)
        frames: deque[np.ndarray] = deque(maxlen=cfg.frame_stack)
        blank = np.zeros(env.frame_shape, np.uint8)
        first = env.reset()
        frames.extend([blank] * (cfg.frame_stack - 1) + [first])  # zero-padded, as the plan
        unwritten.begin(first)
        episode_return, episode_start = 0.0, 0
        while not stopping() and (max_steps is None or self.steps < max_steps):
            if self.weights is not None and self.steps % cfg.sync_every == 0:
                newer = self.weights.load_into(self.net, if_newer_than=self.version)
                self.version = self.version if newer is None else newer
            q = self._q(np.stack(frames))
            if self.rng.random() < self.epsilon:
                action = int(self.rng.integers(env.n_actions))
            else:
                action = int(q.argmax())
            unwritten.acted(q, action)
            if unwritten.ready() >= cfg.flush_rows:
                self._flush(unwritten.take(self.version))
            frame, reward, terminated, truncated = env.step(action)
            unwritten.stepped(frame, clip_reward(cfg.env_id, reward), terminated)
            frames.append(frame)
            episode_return += reward
            self.steps += 1
            if terminated or truncated:
                final = 0.0 if terminated else float(self._q(np.stack(frames)).max())
                self._flush(unwritten.take(self.version, final_value=final))
                if self.end_episode is not None:
                    self.end_episode(truncated=not terminated, **{
                        "return": episode_return, "length": self.steps - episode_start,
                        "ended_ns": time.time_ns()})
                self.episodes += 1
                episode_start = self.steps
                episode_return = 0.0
                first = env.reset()
                frames.extend([blank] * (cfg.frame_stack - 1) + [first])
                unwritten.begin(first)

    def _flush(self, taken: tuple[dict[str, np.ndarray], np.ndarray]) -> None:
        rows, priorities = taken
        self.written_priorities += float(priorities.sum())
        if self.write is not None and len(priorities):
            self.write(rows, priorities)


def make_actor(cfg: ActorConfig) -> Callable[[Any], None]:
    """The function ``ActorGroup`` runs in each actor process (closes over plain values)."""

    def actor(ctx: Any) -> None:
        torch.set_num_threads(1)
        weights = shmbuf.WeightStore.attach(cfg.weights)

        def write(rows: dict[str, np.ndarray], priorities: np.ndarray) -> None:
            while True:  # the learner may hold the actors back (samples per insert)
                try:
                    ctx.writer.extend(rows, priorities=priorities)
                    return
                except RateLimitTimeout:
                    if ctx.stopping:
                        return

        try:
            ApexActor(cfg, ctx.actor_id, ctx.rng, write, ctx.writer.end_episode,
                      weights).run(lambda: ctx.stopping)
        finally:
            weights.close()

    return actor


# --------------------------------------------------------------------------------------------
# The learner
# --------------------------------------------------------------------------------------------
class Learner:
    """Double DQN on n-step, frame-stacked, prioritized batches (importance-weighted Huber)."""

    def __init__(self, frame_shape: tuple[int, ...], n_actions: int, scale: float,
                 args: argparse.Namespace) -> None:
        self.device = torch.device(args.device)
        self.online = QNetwork(frame_shape, args.frame_stack, n_actions, scale).to(self.device)
        self.target = QNetwork(frame_shape, args.frame_stack, n_actions, scale).to(self.device)
        self.target.load_state_dict(self.online.state_dict())
        self.optimizer = torch.optim.Adam(self.online.parameters(), lr=args.learning_rate,
                                          eps=1.5e-4)
        self.target_every = args.target_every
        self.updates = 0

    def update(self, batch: Any) -> tuple[torch.Tensor, float]:
        """One gradient step; returns (|TD error| per row, the loss)."""
        dev = self.device
        obs, next_obs = batch["obs"].to(dev), batch["next_obs"].to(dev)
        action = batch["action"].to(dev).long()
        q = self.online(obs).gather(1, action[:, None]).squeeze(1)
        with torch.no_grad():
            best = self.online(next_obs).argmax(1, keepdim=True)
            bootstrap = self.target(next_obs).gather(1, best).squeeze(1)
            y = batch["reward"].to(dev) + batch["discount"].to(dev) * bootstrap
        td = y - q
        weights = torch.as_tensor(batch.weights, device=dev)
        loss = (weights * F.smooth_l1_loss(q, y, reduction="none")).mean()
        self.optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(self.online.parameters(), 10.0)
        self.optimizer.step()
        self.updates += 1
        if self.updates % self.target_every == 0:
            self.target.load_state_dict(self.online.state_dict())
        return td.detach().abs(), loss.item()


def progress(buf: shmbuf.ReplayBuffer, n: int = RETURN_WINDOW) -> tuple[int, int, float]:
    """(env steps, episodes finished, mean return of the last ``n`` episodes of all lanes).

    A lane's ``committed`` counts its rows, and a derived-next_obs buffer adds one row (the
    final observation) per episode end: env steps are rows less episodes."""
    lanes = buf.stats()["per_lane"]
    steps = sum(lane["committed"] - lane["episode"] for lane in lanes)
    episodes = sum(lane["episode"] for lane in lanes)
    rec = buf.episodes()
    if not rec["episode"].size:
        return steps, episodes, float("nan")
    last = np.argsort(rec["ended_ns"], kind="stable")[-n:]
    return steps, episodes, float(rec["return"][last].mean())


def random_policy(args: argparse.Namespace) -> float:
    """Mean return of a uniformly random policy over ``--random-episodes`` episodes."""
    env = make_env(args.env, args.seed, args.max_episode_steps)
    rng = np.random.default_rng(args.seed)
    returns = []
    t0 = time.monotonic()
    for _ in range(args.random_episodes):
        env.reset()
        total, done = 0.0, False
        while not done:
            _, reward, terminated, truncated = env.step(int(rng.integers(env.n_actions)))
            total += reward
            done = terminated or truncated
        returns.append(total)
    env.close()
    mean = float(np.mean(returns))
    print(f"random policy: mean return {mean:.3f} (std {np.std(returns):.3f}) over "
          f"{len(returns)} episodes of {args.env} in {time.monotonic() - t0:.1f} s", flush=True)
    return mean


def train(args: argparse.Namespace) -> dict[str, float]:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.learner_threads)
    probe = make_env(args.env, args.seed, args.max_episode_steps)  # a bad id fails here
    frame_shape, n_actions, scale = probe.frame_shape, probe.n_actions, probe.scale
    probe.close()
    spec = shmbuf.Spec(obs=(frame_shape, "uint8"), action=((), "uint8"),
                       reward=((), "float32"), terminated=((), "bool"),
                       version=((), "int32"))  # the weights version the actor acted with
    learner = Learner(frame_shape, n_actions, scale, args)
    spi = args.samples_per_insert or None
    limit = shmbuf.RateLimit(args.learning_starts, spi,
                             max(8 * args.batch_size, 4 * args.flush_rows * (spi or 0)))
    plan = Plan(frame_stack=args.frame_stack, n_step=args.n_step, gamma=args.gamma)
    pool_device = args.device if args.device.startswith("cuda") else None
    with shmbuf.ReplayBuffer.create(spec, args.capacity // args.actors, lanes=args.actors,
                                    next_obs="derived", episode_spec=EPISODE_SPEC,
                                    actor_priorities=True) as buf, \
            shmbuf.WeightStore.create(template=learner.online.state_dict()) as weights:
        published = weights.publish(learner.online)  # version 1, before any actor starts
        cfg = ActorConfig(args.env, args.actors, weights.name, args.frame_stack, args.n_step,
                          args.gamma, args.flush_rows, args.max_episode_steps, args.sync_every)
        with ActorGroup(make_actor(cfg), args.actors, buf, start_method=args.start_method,
                        seed=args.seed) as actors, \
                SamplerPool(buf, args.batch_size,
                            selection=Prioritized(alpha=args.alpha, beta=args.beta),
                            limit=limit, plan=plan,
                            workers=Workers(args.workers, start_method=args.start_method),
                            output="torch", device=pool_device, seed=args.seed) as pool:
            print(f"{args.env}: {args.actors} actors (epsilons "
                  f"{', '.join(f'{apex_epsilon(i, args.actors):.4f}' for i in range(args.actors))}"
                  f"), buffer {buf.name}, weights {weights.name}, batch {args.batch_size}, "
                  f"frame stack {args.frame_stack}, n-step {args.n_step}, actor priorities",
                  flush=True)
            t0 = time.monotonic()
            last_t, last_steps, last_updates = t0, 0, 0
            next_report = t0 + args.report_every
            newest_version, lags, loss, last_wait = 0, [], float("nan"), 0.0
            while time.monotonic() - t0 < args.seconds and not (
                    args.until_version and newest_version >= args.until_version):
                try:
                    batch = pool.next(timeout=min(10.0, max(0.1, args.seconds)))
                except shmbuf.Timeout:
                    actors.poll()  # an actor's exception surfaces here
                    continue
                td, loss = learner.update(batch)
                pool.update_priorities(batch.indices, td)
                versions = batch["version"]
                newest_version = max(newest_version, int(versions.max()))
                lags.append(published - int(versions.max()))
                if learner.updates % args.publish_every == 0:
                    published = weights.publish(learner.online)
                now = time.monotonic()
                if now >= next_report:
                    actors.poll()  # re-raises an actor's exception, restarts a crashed one
                    steps, episodes, ret = progress(buf)
                    wait_s = pool.stats()["learner_wait_s"]
                    wait, last_wait = (wait_s - last_wait) / (now - last_t), wait_s
                    print(f"{now - t0:6.1f}s  env steps/s {(steps - last_steps) / (now - last_t):7.0f}"
                          f"  updates/s {(learner.updates - last_updates) / (now - last_t):6.1f}"
                          f"  episodes {episodes:5d}  return({RETURN_WINDOW}) {ret:7.2f}"
                          f"  loss {loss:.4f}  actor lag {np.mean(lags):4.1f} versions"
                          f"  weights v{published}  learner wait {100 * wait:3.0f}%"
                          + (f"  actor restarts {actors.restarts}" if actors.restarts else ""),
                          flush=True)
                    last_t, last_steps, last_updates, lags = now, steps, learner.updates, []
                    next_report = now + args.report_every
            steps, episodes, ret = progress(buf)
            result = {"seconds": time.monotonic() - t0, "env_steps": steps,
                      "updates": learner.updates, "episodes": episodes, "mean_return": ret,
                      "published": published, "newest_version_read": newest_version}
    print(f"result: mean return of the last {RETURN_WINDOW} episodes {ret:.2f} after "
          f"{steps} env steps, {learner.updates} updates, {episodes} episodes in "
          f"{result['seconds']:.1f} s; actors acted with weights versions up to "
          f"{newest_version} of {published} published", flush=True)
    return result


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.random_episodes:
        random_policy(arguments)
    else:
        train(arguments)
