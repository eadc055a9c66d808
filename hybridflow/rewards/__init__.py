"""hybridflow.rewards"""
