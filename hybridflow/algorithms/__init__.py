"""hybridflow.algorithms"""
