"""Rollout service: action grammar and prompts, policy client, inference servers, episode runner."""
