"""Demonstrations in other projects' formats: OSWorld result folders, AgentNet lines, and the
pyautogui code both record actions in, read into Dartboard's actions and written back out."""
