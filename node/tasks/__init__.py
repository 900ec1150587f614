"""What a node trains on and how (imports ``node.models`` only).

``tasks`` builds each task (digits, byte LM, chat) with its data and its federated state;
``digits``, ``corpus``, ``instruct_data`` and ``general_data`` are their data, ``lm`` the byte
LM's training loop, ``dp_sgd`` example-level DP-SGD, ``workload`` the chat workload a node
serves between rounds.
"""
