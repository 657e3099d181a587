package idempotency

// Benchmarks of the work the interceptor does in process on every call,
// around the database round trips (which `go run ./internal/bench`
// measures):
//
//	go test -run '^$' -bench . -benchmem
//
// They use the annotated test service, so policy lookups read real
// descriptors and requests and responses have realistic encodings.

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// benchKey is a UUIDv7, the key the client interceptor generates.
const benchKey = "019a7c3e-5b2d-7f41-9c3a-6d8e2f1b4a07"

func benchRequest(bodyBytes int) *testingv1.Request {
	return &testingv1.Request{Body: strings.Repeat("x", bodyBytes), Meta: &testingv1.Meta{RequestId: benchKey}, Amount: 12345}
}

func benchResponse(bodyBytes int) *testingv1.Response {
	return &testingv1.Response{Body: strings.Repeat("y", bodyBytes), LedgerId: 987654321}
}

// incoming is the metadata of a typical gRPC call as the server sees it.
func incoming(key string) context.Context {
	md := metadata.Pairs(":authority", "127.0.0.1:50051", "content-type", "application/grpc", "user-agent", "grpc-go/1.85.0")
	if key != "" {
		md.Append(MetadataKey, key)
	}
	return metadata.NewIncomingContext(context.Background(), md)
}

var sizes = []struct {
	name  string
	bytes int
}{{"64B", 64}, {"4KiB", 4096}}

func BenchmarkValidateKey(b *testing.B) {
	b.ReportAllocs()
	for b.Loop() {
		if err := ValidateKey(benchKey); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkKeyFromIncoming(b *testing.B) {
	for _, bc := range []struct{ name, key string }{{"key", benchKey}, {"no-key", ""}} {
		b.Run(bc.name, func(b *testing.B) {
			md, _ := metadata.FromIncomingContext(incoming(bc.key))
			b.ReportAllocs()
			for b.Loop() {
				if _, _, err := keyFromIncoming(md); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkFingerprint(b *testing.B) {
	for _, sz := range sizes {
		b.Run(sz.name, func(b *testing.B) {
			req := benchRequest(sz.bytes)
			b.ReportAllocs()
			for b.Loop() {
				if _, err := Fingerprint(testingv1.PolicyService_Required_FullMethodName, req); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkRequestDigest is what derived keys cost every gRPC call: the
// request's digest, taken before the handler runs; compare with
// BenchmarkFingerprint of the same sizes, run beside it.
func BenchmarkRequestDigest(b *testing.B) {
	for _, sz := range sizes {
		b.Run(sz.name, func(b *testing.B) {
			req := benchRequest(sz.bytes)
			b.ReportAllocs()
			for b.Loop() {
				requestDigest(req, defaultDerivedKeyVersion)
			}
		})
	}
}

// BenchmarkPolicyFor is the per-call lookup of a method's resolved policy,
// after the first call resolved and cached it.
func BenchmarkPolicyFor(b *testing.B) {
	for _, bc := range []struct{ name, method string }{
		{"annotated", testingv1.PolicyService_NaturalKey_FullMethodName},
		{"unregistered", "/bench.Unregistered/Call"},
	} {
		b.Run(bc.name, func(b *testing.B) {
			policyFor(bc.method)
			b.ReportAllocs()
			for b.Loop() {
				policyFor(bc.method)
			}
		})
	}
}

// BenchmarkResponse is the response's way into the key table (the
// deterministic encoding and type name Store.execute stores) and back out
// on a replay (Store.replay).
func BenchmarkResponse(b *testing.B) {
	for _, sz := range sizes {
		resp := benchResponse(sz.bytes)
		b.Run("store/"+sz.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				_ = string(resp.ProtoReflect().Descriptor().FullName())
				if _, err := (proto.MarshalOptions{Deterministic: true}).Marshal(resp); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run("replay/"+sz.name, func(b *testing.B) {
			stored, err := proto.Marshal(resp)
			if err != nil {
				b.Fatal(err)
			}
			typ := string(resp.ProtoReflect().Descriptor().FullName())
			fp := []byte(strings.Repeat("f", 32))
			call := Call{Key: benchKey, Method: testingv1.PolicyService_Required_FullMethodName, Fingerprint: fp}
			rec := record{method: call.Method, fingerprint: fp, state: "succeeded", responseType: &typ, response: stored}
			c := &callRun{s: &Store{}, call: call, tp: &transport{}}
			b.ReportAllocs()
			for b.Loop() {
				if res, err := c.replay(rec); err != nil || res.Outcome != OutcomeReplayed {
					b.Fatal(res.Outcome, err)
				}
			}
		})
	}
}

// BenchmarkPassThrough is the whole interceptor on calls it lets through
// without touching the store: a method that takes keys called without one,
// and a method whose descriptor switches idempotency off.
func BenchmarkPassThrough(b *testing.B) {
	store, err := NewStore((*pgxpool.Pool)(nil)) // never used: nothing here reaches the database
	if err != nil {
		b.Fatal(err)
	}
	icpt := UnaryServerInterceptor(store)
	resp := benchResponse(64)
	handler := func(context.Context, any) (any, error) { return resp, nil }
	for _, bc := range []struct{ name, method string }{
		{"no-key", testingv1.PolicyService_Unannotated_FullMethodName},
		{"disabled", testingv1.PolicyService_Disabled_FullMethodName},
	} {
		b.Run(bc.name, func(b *testing.B) {
			ctx, req := incoming(""), benchRequest(64)
			info := &grpc.UnaryServerInfo{FullMethod: bc.method}
			b.ReportAllocs()
			for b.Loop() {
				if _, err := icpt(ctx, req, info, handler); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
