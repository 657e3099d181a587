package idempotency

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// Policy resolution from descriptors, without a server or a database.
func TestUnitPolicyResolution(t *testing.T) {
	t.Parallel()
	const svc = "/idempotency.testing.v1.PolicyService/"
	for _, tc := range []struct {
		method        string
		mode          keyMode
		ttl           time.Duration
		keyPath       string
		err           string
		isolation     pgx.TxIsoLevel
		clientKey     bool // the client generates a key
		retryWithout  bool // a keyless call may be retried
		knownToClient bool
	}{
		{method: "Required", mode: modeRequired, clientKey: true, knownToClient: true},
		{method: "Optional", mode: modeOptional, clientKey: true, knownToClient: true},
		{method: "Disabled", mode: modePassThrough, knownToClient: true},
		{method: "NoSideEffects", mode: modePassThrough, retryWithout: true, knownToClient: true},
		{method: "Idempotent", mode: modePassThrough, retryWithout: true, knownToClient: true},
		{method: "RequiredDespiteLevel", mode: modeRequired, clientKey: true, retryWithout: true, knownToClient: true},
		{method: "Unannotated", mode: modeDefault, clientKey: true, knownToClient: true},
		{method: "NaturalKey", mode: modeRequired, keyPath: "meta.request_id", retryWithout: true, knownToClient: true},
		{method: "ShortTTL", mode: modeDefault, ttl: 200 * time.Millisecond, clientKey: true, knownToClient: true},
		{method: "BadKeyField", err: `has no field "missing"`, knownToClient: true},
		{method: "NonStringKeyField", err: "the key must be a string field", knownToClient: true},
		{method: "Serializable", mode: modeRequired, isolation: pgx.Serializable, clientKey: true, knownToClient: true},
	} {
		p := resolvePolicy(svc+tc.method, nil)
		require.Equal(t, tc.knownToClient, p.known, tc.method)
		if tc.err != "" {
			require.ErrorContains(t, p.err, tc.err, tc.method)
			require.ErrorContains(t, p.err, tc.method, "%s: the error names the method", tc.method)
			continue
		}
		require.NoError(t, p.err, tc.method)
		require.Equal(t, tc.mode, p.mode, tc.method)
		require.Equal(t, tc.ttl, p.ttl, tc.method)
		require.Equal(t, tc.keyPath, p.keyPath, tc.method)
		require.Equal(t, tc.isolation, p.isolation, tc.method)
		require.Equal(t, tc.clientKey, p.clientGeneratesKey(true), "%s: client generates a key", tc.method)
		require.Equal(t, tc.retryWithout, p.retrySafeWithoutKey(), "%s: retry without a key", tc.method)
	}

	unknown := resolvePolicy("/no.such.Service/Method", nil)
	require.False(t, unknown.known)
	require.Equal(t, modeDefault, unknown.mode)
	require.True(t, unknown.clientGeneratesKey(true))
	require.False(t, unknown.clientGeneratesKey(false))
	require.False(t, resolvePolicy("not a method name", nil).known)

	require.Equal(t, policyFor(svc+"Required"), policyFor(svc+"Required"), "cached")
}

// The policy of a call is resolved once per method and request type; a
// call then only looks it up. Not parallel: AllocsPerRun must not be.
func TestUnitPolicyForRequestIsCached(t *testing.T) {
	const method = "/idempotency.testing.v1.PolicyService/NaturalKey"
	req := &testingv1.Request{}
	p := policyForRequest(method, req)
	require.Equal(t, "meta.request_id", p.keyPath)
	require.Equal(t, policyFor(method).mode, p.mode, "a generated request finds the registry's descriptor")
	require.Equal(t, policyFor(method).keyPath, p.keyPath)
	allocs := testing.AllocsPerRun(100, func() { _ = policyForRequest(method, req) })
	require.Zero(t, allocs, "a cached policy is looked up, not resolved again")
	require.Equal(t, policyFor(method), policyForRequest(method, "not a proto message"))
}

// gRPC's own services pass through on the server, get no key from the
// client and may be retried, whether or not their descriptors are linked
// in; a service that only looks like one does not.
func TestUnitPolicyInfrastructureServices(t *testing.T) {
	t.Parallel()
	for _, method := range []string{
		"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch", "/grpc.health.v1.Health/List",
		"/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
		"/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
		"/grpc.channelz.v1.Channelz/GetTopChannels",
		"/envoy.service.status.v3.ClientStatusDiscoveryService/FetchClientStatus",
		"/xds.service.orca.v3.OpenRcaService/StreamCoreMetrics",
		"/grpc.lookup.v1.RouteLookupService/RouteLookup",
	} {
		p := policyFor(method)
		require.Equal(t, modePassThrough, p.mode, method)
		require.NoError(t, p.err, method)
		require.False(t, p.clientGeneratesKey(true), method)
		require.True(t, p.retrySafeWithoutKey(), method)
	}
	for _, method := range []string{"/grpc.health.v2.Health/Check", "/acme.grpc.health.v1.Health/Check", "/grpc.testing.TestService/UnaryCall"} {
		require.Equal(t, modeDefault, policyFor(method).mode, method)
	}
}
