"""CleanRL's single-file DQN (dqn.py, CartPole-v1) with its replay buffer in shared memory.

The one change from CleanRL is the import of ``ReplayBuffer`` (CleanRL imports SB3's). Run:
``python examples/cleanrl_dqn.py --total-timesteps 5000`` (needs ``pip install -e '.[sb3]'``).
"""

from __future__ import annotations

import argparse
import random
import time

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# from stable_baselines3.common.buffers import ReplayBuffer    # CleanRL's line
from shmbuf.integrations.sb3 import ReplayBuffer  # the swap: the same class, in /dev/shm


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--env-id", default="CartPole-v1")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--num-envs", type=int, default=1)
    p.add_argument("--total-timesteps", type=int, default=500_000)
    p.add_argument("--learning-rate", type=float, default=2.5e-4)
    p.add_argument("--buffer-size", type=int, default=10_000)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--tau", type=float, default=1.0)
    p.add_argument("--target-network-frequency", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--start-e", type=float, default=1.0)
    p.add_argument("--end-e", type=float, default=0.05)
    p.add_argument("--exploration-fraction", type=float, default=0.5)
    p.add_argument("--learning-starts", type=int, default=1_000)
    p.add_argument("--train-frequency", type=int, default=10)
    return p.parse_args()


class QNetwork(nn.Module):
    def __init__(self, env: gym.vector.VectorEnv) -> None:
        super().__init__()
        obs_dim = int(np.prod(env.single_observation_space.shape))
        self.network = nn.Sequential(nn.Linear(obs_dim, 120), nn.ReLU(), nn.Linear(120, 84),
                                     nn.ReLU(), nn.Linear(84, env.single_action_space.n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)


def linear_schedule(start_e: float, end_e: float, duration: float, t: int) -> float:
    return max(end_e, start_e + (end_e - start_e) * t / duration)


def main() -> None:
    args = parse_args()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # a small MLP: one thread is fastest
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    envs = gym.vector.SyncVectorEnv(
        [lambda: gym.wrappers.RecordEpisodeStatistics(gym.make(args.env_id))
         for _ in range(args.num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    q_network = QNetwork(envs).to(device)
    optimizer = torch.optim.Adam(q_network.parameters(), lr=args.learning_rate)
    target_network = QNetwork(envs).to(device)
    target_network.load_state_dict(q_network.state_dict())

    rb = ReplayBuffer(args.buffer_size, envs.single_observation_space,
                      envs.single_action_space, device, n_envs=args.num_envs,
                      handle_timeout_termination=False)
    start, returns = time.time(), []
    obs, _ = envs.reset(seed=args.seed)
    try:
        for global_step in range(args.total_timesteps):
            epsilon = linear_schedule(args.start_e, args.end_e,
                                      args.exploration_fraction * args.total_timesteps,
                                      global_step)
            if random.random() < epsilon:
                actions = np.array([envs.single_action_space.sample()
                                    for _ in range(envs.num_envs)])
            else:
                q_values = q_network(torch.Tensor(obs).to(device))
                actions = torch.argmax(q_values, dim=1).cpu().numpy()

            next_obs, rewards, terminations, truncations, infos = envs.step(actions)
            final = infos.get("final_info", {})  # the ended episodes' statistics
            if "episode" in final:
                returns.extend(final["episode"]["r"][final["_episode"]].tolist())

            real_next_obs = next_obs.copy()  # the true final observation where one ended
            for idx, done in enumerate(np.logical_or(terminations, truncations)):
                if done:
                    real_next_obs[idx] = infos["final_obs"][idx]
            rb.add(obs, real_next_obs, actions, rewards, terminations, infos)
            obs = next_obs

            if global_step > args.learning_starts and global_step % args.train_frequency == 0:
                data = rb.sample(args.batch_size)
                with torch.no_grad():
                    target_max, _ = target_network(data.next_observations).max(dim=1)
                    td_target = data.rewards.flatten() + args.gamma * target_max * (
                        1 - data.dones.flatten())
                old_val = q_network(data.observations).gather(1, data.actions).squeeze()
                loss = F.mse_loss(td_target, old_val)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()

            if global_step % args.target_network_frequency == 0:
                for target_p, q_p in zip(target_network.parameters(), q_network.parameters()):
                    target_p.data.copy_(args.tau * q_p.data + (1.0 - args.tau) * target_p.data)
    finally:
        rb.close()  # unlinks the segment (also done at exit)
        envs.close()
    recent = returns[-10:]
    print(f"{args.total_timesteps} steps in {time.time() - start:.1f}s, {len(returns)} episodes, "
          f"mean return of the last {len(recent)}: {np.mean(recent) if recent else 0:.1f}")


if __name__ == "__main__":
    main()
