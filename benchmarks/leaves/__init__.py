"""Many small leaves: the per-leaf squared norms' cost on ResNet-like trees and the flagship CNN's drop-in step."""
