"""Tool calls: the tools of a request rendered through the model's chat template, the model's output
parsed back into calls in the syntax its template writes them, and, when a call is required, decoding
held to that syntax with each tool's JSON-schema arguments.

  calls     what a tool, a call and a tool_choice are, checked as the request gives them
  messages  request messages (OpenAI and Anthropic) as the chat template's turns, tool calls included
  formats   one module per family's call syntax: parse a reply, write its grammar
  template  which syntax (if any) a chat template writes, found by rendering a call through it
  grammar   the token mask of a grammar (llguidance) that the sampler applies
  stream    streamed text held back while it may be the start of a call
"""
