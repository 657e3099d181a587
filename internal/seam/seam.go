// Package seam joins package idempotency, whose engine serves the unary
// calls of every RPC framework, and package unary, which lends that engine
// to the adapters of frameworks other than grpc-go. unary imports
// idempotency (its constructors take a *idempotency.Store and its
// options), so idempotency cannot import unary: the two meet here instead.
// idempotency registers its server and client at init; unary converts its
// own types to and from these.
package seam

import (
	"context"

	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
)

// Call is a unary call as a framework received it (unary.Call).
type Call struct {
	Method    string
	Request   proto.Message
	Metadata  metadata.MD
	Transport string // an idempotency.Transport; "" is gRPC
}

// Metadata is a response's headers and trailers (unary.Metadata).
type Metadata struct {
	Header, Trailer metadata.MD
	Adapter         []byte
}

// Handler runs a framework's handler (unary.Handler).
type Handler func(ctx context.Context) (proto.Message, Metadata, error)

// Reply is what an adapter sends its client (unary.Reply).
type Reply struct {
	Response proto.Message
	Metadata
	Outcome int // an idempotency.Outcome
}

// Attempt sends one attempt of a call (unary.Attempt).
type Attempt func(ctx context.Context, md metadata.MD) error

// Server is the engine's server side for unary calls (unary.Server).
type Server interface {
	Serve(ctx context.Context, call Call, handler Handler) (Reply, error)
	RefuseStream(method string, md metadata.MD, req proto.Message) error
}

// Client is the engine's client side for unary calls (unary.Client).
type Client interface {
	Invoke(ctx context.Context, method string, req proto.Message, md metadata.MD, attempt Attempt) (key string, err error)
}

// Set by package idempotency at init, before any package that imports it
// runs. store is a non-nil *idempotency.Store, opts an
// []idempotency.ServerOption or []idempotency.ClientOption: unary's
// constructors take those types and pass them on as they are.
var (
	NewServer func(store, opts any) (Server, error)
	NewClient func(opts any) (Client, error)
)
