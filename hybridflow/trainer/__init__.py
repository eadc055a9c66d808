"""hybridflow.trainer"""
