"""Benchmarks: `tandem bench serve|sweep|throughput|latency|kernels`.

serve and sweep measure any OpenAI-compatible endpoint from the outside
(datasets.py what is sent, arrivals.py when, client.py how, metrics.py what
it means, report.py and plots.py what is written down).
"""
