package idempotency_test

import (
	"log"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/retry"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/exactlyonce/idempotency"
)

// The client connections that docs/grpc-client.md shows for a service with
// retries of its own: the key interceptor makes one attempt and keeps the
// key, and the retries below it send every attempt with that key.

// ownRetryChain retries with go-grpc-middleware's interceptor, below the
// key interceptor.
func ownRetryChain() *grpc.ClientConn {
	conn, err := grpc.NewClient("127.0.0.1:50051",
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithChainUnaryInterceptor(
			idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(1)), // outside: one key per logical call
			retry.UnaryClientInterceptor(retry.WithMax(5), retry.WithCodes(codes.Unavailable, codes.Aborted)),
		),
	)
	if err != nil {
		log.Fatal(err)
	}
	return conn
}

// nativeRetryPolicy retries with gRPC's own retry policy, which runs below
// every interceptor.
func nativeRetryPolicy() *grpc.ClientConn {
	conn, err := grpc.NewClient("127.0.0.1:50051",
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(1))),
		grpc.WithDefaultServiceConfig(`{
		  "methodConfig": [{
		    "name": [{"service": "payments.v1.PaymentService"}],
		    "retryPolicy": {
		      "maxAttempts": 5,
		      "initialBackoff": "0.01s",
		      "maxBackoff": "0.2s",
		      "backoffMultiplier": 2,
		      "retryableStatusCodes": ["UNAVAILABLE", "ABORTED", "RESOURCE_EXHAUSTED"]
		    }
		  }]
		}`),
	)
	if err != nil {
		log.Fatal(err)
	}
	return conn
}

var _, _ = ownRetryChain, nativeRetryPolicy // shown in the docs, compiled here
